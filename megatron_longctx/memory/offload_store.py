"""One offloaded storage: where its bytes went (a host pool buffer or a file), how they come back to the
device whole or one row range at a time, and what is handed back once its last saved view is gone.
:class:`~megatron_longctx.memory.offload.ActivationOffloader` makes them; the offloader passed in gives the
streams, the I/O worker and the pool (:mod:`.streams` states the stream contract).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from typing import Any, Optional

import torch

from megatron_longctx.memory.host_pool import HostPool
from megatron_longctx.memory.offload_disk import read_file, remove_file, write_file


class Stored:
    """One storage's bytes off the device: where they are and how to bring them back."""

    def __init__(self, offloader: Any, src: torch.Tensor, group: tuple) -> None:
        self.device, self.nbytes, self.group = src.device, src.numel(), group
        self.on_device = offloader.ops.is_device(src)
        self._off = offloader
        self._host: Optional[torch.Tensor] = None  # pool buffer (host target)
        self._path: Optional[str] = None
        self._write: Optional[cf.Future] = None
        self._read: Optional[cf.Future] = None
        self._copied: Any = None  # event of the device-to-host copy
        self._fetched: Any = None  # event of the host-to-device copy
        self._restored: Optional[torch.Tensor] = None
        self._ahead: Optional[tuple] = None  # ((start, nbytes), buffer, event): the next row range, prefetched

    # -- forward: ``src`` is not kept; the caller drops the last reference the offloader has ------------
    def start_to_host(self, src: torch.Tensor, host: torch.Tensor) -> None:
        self._host = host
        self._copied = self._off.copy_to_host(host, src)

    def start_to_disk(self, src: torch.Tensor, path: str, staging: Optional[torch.Tensor]) -> None:
        self._path = path
        if self.on_device:  # staged through a pinned buffer; the worker waits for the copy, then writes
            assert staging is not None
            event = self._copied = self._off.copy_to_host(staging, src)
            self._write = self._off.submit_io(_write_staged, self._off, event, staging, path)
        else:  # a CPU process: the worker writes the tensor itself and then lets it go
            self._write = self._off.submit_io(write_file, src, path)

    host_from_pool = property(lambda self: self._host is not None)
    host_buffer = property(lambda self: self._host)
    path = property(lambda self: self._path)
    write = property(lambda self: self._write)

    # -- backward --------------------------------------------------------------------------------
    def prefetch(self) -> None:
        if self._restored is not None or self._read is not None or self._fetched is not None:
            return
        if self._path is not None:
            self._read = self._off.submit_io(_read_after, self._write, self._path, self.nbytes)
            return
        assert self._host is not None and self.on_device
        self._restored, self._fetched = self._from_host(self._host)

    def _from_host(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``host`` bytes (of the pool buffer) copied to a compute-stream buffer on the side stream: (buffer,
        event of the copy).  A later forward's copy into the same pool buffer, also on the side stream,
        cannot overtake it."""
        ops, side = self._off.ops, self._off.side_stream(self.device)
        compute = ops.current(self.device)
        buf = ops.empty(host.numel(), self.device)  # [nbytes] uint8, a compute-stream allocation
        ops.wait_stream(side, compute)  # the block may have just been freed by compute-stream work
        with ops.use(side):
            if self._copied is not None:
                ops.wait_event(side, self._copied)
            ops.copy(buf, host)
            fetched = ops.record_event(side)
        ops.record_stream(buf, side)
        return buf, fetched

    def get_range(self, start: int, nbytes: int, ahead: Optional[tuple] = None) -> torch.Tensor:
        """Bytes ``[start, start + nbytes)`` of the storage back on its device, ``[nbytes]`` uint8, alone.

        ``ahead``: ``(start, nbytes)`` of the range the caller reads next; its copy is started now, into a
        second buffer, so it runs while the caller computes on this one."""
        if self._restored is not None or self._read is not None or self._fetched is not None:
            return self.get()[start:start + nbytes]  # already coming back whole
        if self._path is not None and not self.on_device:
            return _read_after(self._write, self._path, nbytes, start)  # [nbytes] uint8 host
        got, self._ahead = self._ahead, None
        buf, event = got[1:] if got is not None and got[0] == (start, nbytes) else self._range_to_device(start, nbytes)
        if ahead is not None:
            self._ahead = (tuple(ahead), *self._range_to_device(*ahead))
        return self._off.rows_ready(buf, event)

    def _range_to_device(self, start: int, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A row range's copy to the device started on the side stream: (side-stream buffer, event)."""
        if self._path is None:
            assert self._host is not None and self.on_device
            return self._off.rows_to_device(self._host[start:start + nbytes], self.device, self._copied)
        # staged through pinned memory (torch's cached host blocks: one is not reused before its copy has run)
        staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._off.pool.pin)
        return self._off.rows_to_device(_read_after(self._write, self._path, nbytes, start, staging), self.device)

    def get(self) -> torch.Tensor:
        """The storage's bytes back on their device, ``[nbytes]`` uint8."""
        self.prefetch()
        ops = self._off.ops
        if self._read is not None:
            data = self._read.result()  # [nbytes] uint8 host
            self._read = None
            if self.on_device:
                buf = ops.empty(self.nbytes, self.device)
                ops.copy(buf, data)  # on the compute stream
                data = buf
            self._restored = data
        if self._fetched is not None:
            ops.wait_event(ops.current(self.device), self._fetched)
            self._fetched = None
        assert self._restored is not None
        return self._restored


@dataclasses.dataclass
class Resources:
    """What must be handed back when the last saved view of a storage is gone."""

    pool: Optional[HostPool] = None
    host: Optional[torch.Tensor] = None
    path: Optional[str] = None
    write: Optional[cf.Future] = None

    def release(self) -> None:
        if self.pool is not None and self.host is not None:
            self.pool.give(self.host)  # later users of a pool buffer are ordered on the same side stream
        self.host = None
        if self.path is not None:
            path, write = self.path, self.write
            self.path = None
            if write is None or write.done():
                remove_file(path)
            else:  # never block a finalizer on I/O
                write.add_done_callback(lambda _: remove_file(path))


def _write_staged(off: Any, event: Any, staging: torch.Tensor, path: str) -> None:
    try:
        off.ops.sync_event(event)  # the device-to-host copy into ``staging`` has landed
        write_file(staging, path)
    finally:
        off.pool.give(staging)


def _read_after(write: Optional[cf.Future], path: str, nbytes: int, offset: int = 0,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    if write is not None:
        write.result()  # re-raises a failed write (DiskOffloadError)
    return read_file(path, nbytes, offset, out)


@dataclasses.dataclass(frozen=True)
class SavedView:
    """How to rebuild the saved tensor from its storage's bytes."""

    stored: Stored
    dtype: torch.dtype
    size: tuple
    stride: tuple
    offset: int  # in elements of ``dtype``
