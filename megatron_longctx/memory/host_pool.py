"""The bounded host buffer pool of the activation offloader (pinned memory when a GPU is present).

Every byte the pool holds counts against ``capacity``: buffers handed out (``used``) and buffers given
back and kept for reuse (``cached``).  A request that does not fit first frees cached buffers of other
sizes (oldest first); if it still does not fit it is refused (``None``) and the caller keeps its
tensor on the device.  So the pool never holds more than its bound, whatever mix of sizes it sees.

Pinned buffers come from PyTorch's caching host allocator, which rounds each block up to a power of
two and keeps freed blocks: the pool charges the rounded size.  An evicted buffer's block goes back to
that allocator's cache, which serves the next pinned requests from it; the cache is emptied only when
the pool is cleared (:meth:`HostPool.clear`).  Emptying it on eviction, mid-forward, would synchronise
the device and drop every other owner's cached pinned blocks (the data loader's, NCCL's, ...).
"""

from __future__ import annotations

import collections
import threading
from typing import Optional

import torch


class HostPool:
    """Host ``[nbytes]`` uint8 buffers bounded by ``capacity`` bytes; freed buffers are reused by size."""

    def __init__(self, capacity: int, pin: Optional[bool] = None) -> None:
        self.capacity, self.used, self.cached = capacity, 0, 0
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.evicted_bytes = 0  # cached buffers freed to make room for another size
        self.refused = 0
        self._free: "collections.OrderedDict[int, list[torch.Tensor]]" = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Bytes the pool holds now: handed out plus cached."""
        return self.used + self.cached

    def charge(self, nbytes: int) -> int:
        """Bytes a buffer of ``nbytes`` really holds (pinned blocks are rounded up to a power of two)."""
        return 1 << max(nbytes - 1, 0).bit_length() if self.pin else nbytes

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        """A buffer of exactly ``nbytes`` bytes, or None when the bound does not allow one."""
        cost = self.charge(nbytes)
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                buf = free.pop()
                if not free:
                    del self._free[nbytes]
                self.cached -= cost
                self.used += cost
                return buf
            if self.used + cost > self.capacity:
                self.refused += 1
                return None
            while self.used + self.cached + cost > self.capacity:  # evict other sizes, oldest first
                size, bufs = next(iter(self._free.items()))
                bufs.pop()
                if not bufs:
                    del self._free[size]
                self.cached -= self.charge(size)
                self.evicted_bytes += self.charge(size)
            self.used += cost
        try:
            return self._new(nbytes)
        except RuntimeError:
            with self._lock:
                self.used -= cost
                self.refused += 1
            return None

    def _new(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        """Hand ``buf`` back; it is cached for the next request of its size."""
        nbytes = buf.numel()
        with self._lock:
            self.used -= self.charge(nbytes)
            self.cached += self.charge(nbytes)
            self._free.setdefault(nbytes, []).append(buf)
            self._free.move_to_end(nbytes)

    def clear(self) -> None:
        """Free every cached buffer, and give torch's cached pinned blocks back to the system."""
        with self._lock:
            self._free.clear()
            self.cached = 0
        empty_cache = getattr(torch._C, "_host_emptyCache", None)  # torch >= 2.14
        if self.pin and empty_cache is not None:
            empty_cache()
