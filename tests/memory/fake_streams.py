"""A test double for :class:`megatron_longctx.memory.streams.CudaOps` that records the calls' order.

CPU tensors stand in for device tensors (``is_device`` is true for all), copies run at once, and
events land only when the test says so (``auto_land``) or when something synchronises on them, so a
test sees exactly what the offloader asked the streams to do and when it let go of each buffer.
Each tensor the double sees gets a name (``t0``, ``t1``...) and a ``("free", name)`` entry when the
last Python reference to that tensor object is gone.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref

import torch


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name


class FakeEvent:
    def __init__(self, number: int, landed: bool) -> None:
        self.name, self.landed = f"e{number}", landed


class RecordingOps:
    def __init__(self, auto_land: bool = True) -> None:
        self.log: list[tuple] = []
        self.auto_land = auto_land
        self.compute = FakeStream("compute")
        self._stack = [self.compute]
        self._names: dict[int, str] = {}
        self._count = itertools.count()
        self._events = itertools.count()
        self.events: list[FakeEvent] = []

    def name(self, t: torch.Tensor) -> str:
        key = id(t)
        if key not in self._names:
            name = f"t{next(self._count)}"
            self._names[key] = name
            weakref.finalize(t, self._freed, key, name)
        return self._names[key]

    def _freed(self, key: int, name: str) -> None:
        self._names.pop(key, None)
        self.log.append(("free", name))

    # -- the CudaOps interface -------------------------------------------------------------------
    def is_device(self, t):
        return True

    def current(self, device):
        return self._stack[-1]

    def new_stream(self, device):
        return FakeStream("side")

    @contextlib.contextmanager
    def use(self, stream):
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def wait_stream(self, waiter, waitee):
        self.log.append(("wait_stream", waiter.name, waitee.name))

    def record_event(self, stream):
        event = FakeEvent(next(self._events), self.auto_land)
        self.events.append(event)
        self.log.append(("record_event", stream.name, event.name))
        return event

    def wait_event(self, stream, event):
        self.log.append(("wait_event", stream.name, event.name))

    def done(self, event):
        return event.landed

    def sync_event(self, event):
        event.landed = True
        self.log.append(("sync_event", event.name))

    def sync_stream(self, stream):
        for event in self.events:
            event.landed = True
        self.log.append(("sync_stream", stream.name))

    def record_stream(self, t, stream):
        self.log.append(("record_stream", self.name(t), stream.name))

    def empty(self, nbytes, device):
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.log.append(("empty", self.name(t), self._stack[-1].name))
        return t

    def copy(self, dst, src):
        dst.copy_(src)
        self.log.append(("copy", self.name(dst), self.name(src), self._stack[-1].name))

    # -- queries for tests -----------------------------------------------------------------------
    def index(self, entry: tuple) -> int:
        return self.log.index(entry)

    def entries(self, kind: str) -> list[tuple]:
        return [e for e in self.log if e[0] == kind]
