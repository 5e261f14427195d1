"""Activation offload through saved-tensor hooks: host (pinned pool) or disk, asynchronous, prefetched.

Forward: a tensor autograd saves inside an offloaded scope is copied off the device (a side CUDA
stream and an event on GPU; a background writer on CPU) and the device copy is released once the copy
has landed.  Backward: the first unpack of a layer's tensors fetches that whole layer and starts
fetching the layer before it (backward runs layers in reverse), so the next layer's tensors arrive while
this layer computes.  Ideas from ALST (checkpoint offload, arXiv:2506.13996) and Megatron/TE activation
offloading (NVIDIA/Megatron-LM), rebuilt without Transformer Engine, with recompute and PP.

Policies (``MemoryConfig.offload_policy``): ``checkpoint`` — only what a full-recompute layer keeps, its
input; ``modules`` — tensors saved inside named modules; ``layers`` — everything saved in the first N
layers.  Parameters are never offloaded.  A tensor is offloaded per *storage*: views of one storage
(and a tensor several layers save, like RoPE tables) travel once.  The host pool is bounded: a tensor
past the bound stays where it is and is counted, never an out-of-memory error.  On a CPU-only process
``host`` cannot lower memory (the tensor already lives in host memory): such tensors are left in
place and counted as ``host_noop_bytes``; ``disk`` is what lowers resident memory there.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import os
import shutil
import tempfile
import threading
import weakref
from typing import Any, Optional

import numpy as np
import torch

from megatron_longctx.memory import hooks
from megatron_longctx.memory.config import MemoryConfig


@dataclasses.dataclass
class OffloadStats:
    """Byte counters of one offloader (all since construction)."""

    offloaded_bytes: int = 0
    offloaded_tensors: int = 0
    deduplicated_bytes: int = 0  # views / shared tensors that reused a storage already offloaded
    kept_over_bound_bytes: int = 0  # the host pool was full: left on the device
    host_noop_bytes: int = 0  # target host but the tensor is already in host memory
    fetched_bytes: int = 0
    prefetched_groups: int = 0


class _HostPool:
    """Pinned host buffers bounded by ``capacity`` bytes; freed buffers are reused by size."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used = capacity, 0
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        with self._lock:
            if self.used + nbytes > self.capacity:
                return None
            self.used += nbytes
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self.used -= buf.numel()
            self._free.setdefault(buf.numel(), []).append(buf)


class _Stored:
    """One storage's bytes off the device: where they are and how to bring them back."""

    def __init__(self, offloader: "ActivationOffloader", src: torch.Tensor, group: tuple) -> None:
        self.device, self.nbytes, self.group = src.device, src.numel(), group
        self._off = offloader
        self._src: Optional[torch.Tensor] = src  # kept alive until the copy has landed
        self._host: Optional[torch.Tensor] = None
        self._path: Optional[str] = None
        self._write: Optional[cf.Future] = None
        self._read: Optional[cf.Future] = None
        self._copied: Any = None  # CUDA event of the device-to-host copy
        self._fetched: Any = None  # CUDA event of the host-to-device copy
        self._restored: Optional[torch.Tensor] = None

    # -- forward ---------------------------------------------------------------------------------
    def start_to_host(self, host: torch.Tensor) -> None:
        self._host = host
        src = self._src
        assert src is not None
        if src.is_cuda:
            stream = self._off.side_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                host.copy_(src, non_blocking=True)
                self._copied = torch.cuda.Event()
                self._copied.record(stream)
            self._off.pending.append(self)
        else:
            host.copy_(src)
            self._src = None

    def start_to_disk(self, path: str) -> None:
        self._path = path
        src = self._src
        assert src is not None
        self._src = None
        host = src.cpu() if src.is_cuda else src  # [n] uint8
        self._write = self._off.submit_io(_write_file, host, path)

    host_from_pool = property(lambda self: self._host is not None and self._path is None)
    host_buffer = property(lambda self: self._host)
    path = property(lambda self: self._path)
    write = property(lambda self: self._write)

    def poll(self) -> bool:
        """True once the device copy can be released (device-to-host copy done)."""
        if self._copied is not None and self._copied.query():
            self._src, self._copied = None, None
        return self._src is None

    # -- backward --------------------------------------------------------------------------------
    def prefetch(self) -> None:
        if self._restored is not None or self._read is not None or self._fetched is not None:
            return
        if self._src is not None and self._copied is None:  # never left (should not happen)
            self._restored = self._src
            return
        if self._path is not None:
            write = self._write
            self._read = self._off.submit_io(_read_after, write, self._path, self.nbytes)
            return
        assert self._host is not None
        if self.device.type == "cuda":
            stream = self._off.side_stream()
            with torch.cuda.stream(stream):
                if self._copied is not None:
                    stream.wait_event(self._copied)
                self._restored = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
                self._restored.copy_(self._host, non_blocking=True)
                self._fetched = torch.cuda.Event()
                self._fetched.record(stream)
        else:
            self._restored = self._host

    def get(self) -> torch.Tensor:
        """The storage's bytes back on their device, ``[nbytes]`` uint8."""
        self.prefetch()
        if self._read is not None:
            data = self._read.result()
            self._read = None
            self._restored = data.to(self.device, non_blocking=True) if self.device.type == "cuda" else data
        if self._fetched is not None:
            torch.cuda.current_stream().wait_event(self._fetched)
            assert self._restored is not None
            self._restored.record_stream(torch.cuda.current_stream())
            self._fetched = None
        assert self._restored is not None
        return self._restored


@dataclasses.dataclass
class _Resources:
    """What must be handed back when the last saved view of a storage is gone."""

    pool: Optional[_HostPool] = None
    host: Optional[torch.Tensor] = None
    path: Optional[str] = None
    write: Optional[cf.Future] = None

    def release(self) -> None:
        if self.pool is not None and self.host is not None:
            self.pool.give(self.host)
        self.host = None
        if self.path is not None:
            path, write = self.path, self.write
            self.path = None
            if write is None or write.done():
                _remove(path)
            else:  # never block a finalizer on I/O
                write.add_done_callback(lambda _: _remove(path))


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _write_file(data: torch.Tensor, path: str) -> None:
    data.numpy().tofile(path)


def _read_after(write: Optional[cf.Future], path: str, nbytes: int) -> torch.Tensor:
    if write is not None:
        write.result()
    return torch.from_numpy(np.fromfile(path, dtype=np.uint8, count=nbytes))


@dataclasses.dataclass(frozen=True)
class _View:
    """How to rebuild the saved tensor from its storage's bytes."""

    stored: _Stored
    dtype: torch.dtype
    size: tuple
    stride: tuple
    offset: int  # in elements of ``dtype``


class ActivationOffloader:
    """Packer for :mod:`megatron_longctx.memory.hooks` that offloads by policy; see module docstring.

    The model wiring (:func:`megatron_longctx.memory.install`) opens :func:`hooks.layer_scope` around
    each transformer layer, :func:`hooks.module_scope` around named submodules, and calls
    :meth:`next_microbatch` at every new forward of the first layer, so that pipeline schedules with
    several micro-batches in flight key their tensors apart.
    """

    def __init__(self, cfg: MemoryConfig, params: tuple = (), num_layers: int = 0) -> None:
        if not cfg.offload_enabled:
            raise ValueError("--longctx-offload-policy: is 'none'; choose checkpoint, modules or layers to offload")
        self.cfg, self.stats = cfg, OffloadStats()
        self.pool = _HostPool(cfg.offload_host_pool_bytes)
        self.pending: list[_Stored] = []
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self._num_layers = num_layers
        self._microbatch = 0
        self._groups: dict[tuple, list[_Stored]] = {}
        self._shared: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self._stream: Any = None
        self._io: Optional[cf.ThreadPoolExecutor] = None
        self._inflight = threading.BoundedSemaphore(cfg.offload_max_inflight)
        self._dir: Optional[str] = None
        self._own_dir = False
        self._counter = 0
        if cfg.offload_target == "disk":
            self._dir = cfg.offload_disk_dir or tempfile.mkdtemp(prefix="longctx-offload-")
            self._own_dir = cfg.offload_disk_dir is None
            os.makedirs(self._dir, exist_ok=True)
            self._io = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="longctx-offload-io")

    def next_microbatch(self) -> None:
        """Start keying tensors under a new micro-batch (and forget the storage-sharing table)."""
        self._microbatch += 1
        self._shared.clear()
        self._groups = {g: refs for g, refs in self._groups.items() if any(r() is not None for r in refs)}

    # -- policy ----------------------------------------------------------------------------------
    def _wanted(self, t: torch.Tensor) -> bool:
        layer = hooks.current_layer()
        if layer is None or isinstance(t, torch.nn.Parameter):
            return False
        if t.numel() * t.element_size() < self.cfg.offload_min_bytes:
            return False
        if t.untyped_storage().data_ptr() in self._param_ptrs:  # views of parameters (weight.t())
            return False
        policy = self.cfg.offload_policy
        if policy == "modules":
            return any(m in self.cfg.offload_modules for m in hooks.current_modules())
        if policy == "layers":
            return self.cfg.offload_num_layers == 0 or layer < self.cfg.offload_num_layers
        return True  # checkpoint: the wiring opens layer scopes only around checkpointed layers

    # -- packer protocol -------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Optional[_View]:
        if not self._wanted(t):
            return None
        if self.cfg.offload_target == "host" and not t.is_cuda:
            self.stats.host_noop_bytes += t.numel() * t.element_size()
            return None
        storage = t.untyped_storage()
        stored = self._shared_storage(t, storage)
        if stored is None:
            whole = (storage.nbytes() <= 2 * t.numel() * t.element_size()
                     and storage.nbytes() % t.element_size() == 0)
            # [storage bytes] uint8 or the tensor alone, contiguous, as [bytes] uint8
            src = (torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage) if whole
                   else t.detach().contiguous().view(-1).view(torch.uint8))
            stored = self._offload(src)
            if stored is None:
                return None
            if whole:
                owner = t._base if t._base is not None else t  # a view's Python object may be a temporary
                self._shared[storage.data_ptr()] = (weakref.ref(owner), weakref.ref(stored))
            offset = t.storage_offset() if whole else 0
            stride = tuple(t.stride()) if whole else _contiguous_stride(t.shape)
        else:
            self.stats.deduplicated_bytes += t.numel() * t.element_size()
            offset, stride = t.storage_offset(), tuple(t.stride())
        return _View(stored, t.dtype, tuple(t.shape), stride, offset)

    def unpack(self, view: _View) -> torch.Tensor:
        stored = view.stored
        if self.cfg.offload_prefetch:
            self._prefetch_group(stored.group)
            layer = stored.group[1]
            if layer is not None and layer > 0:
                self._prefetch_group((stored.group[0], layer - 1))
        data = stored.get()  # [nbytes] uint8
        self.stats.fetched_bytes += view.stored.nbytes
        flat = data.view(view.dtype)  # [nbytes / element_size]
        return torch.as_strided(flat, view.size, view.stride, view.offset)

    # -- internals -------------------------------------------------------------------------------
    def _shared_storage(self, t: torch.Tensor, storage: Any) -> Optional[_Stored]:
        entry = self._shared.get(storage.data_ptr())
        if entry is None:
            return None
        ref, stored_ref = entry
        alive, stored = ref(), stored_ref()
        if alive is None or stored is None or alive.untyped_storage().data_ptr() != storage.data_ptr():
            del self._shared[storage.data_ptr()]
            return None
        return stored

    def _offload(self, src: torch.Tensor) -> Optional[_Stored]:
        """Start moving ``src`` ([n] uint8) off the device; None when the host pool is full."""
        group = (self._microbatch, hooks.current_layer())
        nbytes = src.numel()
        stored = _Stored(self, src, group)
        if self.cfg.offload_target == "host":
            host = self.pool.take(nbytes)
            if host is None:
                self.stats.kept_over_bound_bytes += nbytes
                return None
            stored.start_to_host(host)
        else:
            assert self._dir is not None
            self._counter += 1
            stored.start_to_disk(os.path.join(self._dir, f"mb{group[0]}-l{group[1]}-{self._counter}.bin"))
        weakref.finalize(stored, _Resources.release, _Resources(
            self.pool if stored.host_from_pool else None, stored.host_buffer, stored.path, stored.write))
        self._groups.setdefault(group, []).append(weakref.ref(stored))  # type: ignore[arg-type]
        self.stats.offloaded_bytes += nbytes
        self.stats.offloaded_tensors += 1
        return stored

    def _prefetch_group(self, group: tuple) -> None:
        refs = self._groups.pop(group, None)
        if not refs:
            return
        self.stats.prefetched_groups += 1
        for ref in refs:
            stored = ref()
            if stored is not None:
                stored.prefetch()

    def poll(self) -> None:
        """Release device copies whose device-to-host copy has landed (called after each layer)."""
        self.pending = [s for s in self.pending if not s.poll()]

    def side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def submit_io(self, fn: Any, *args: Any) -> cf.Future:
        """Run ``fn`` on the I/O worker with at most ``offload_max_inflight`` jobs queued."""
        assert self._io is not None
        self._inflight.acquire()
        future = self._io.submit(fn, *args)
        future.add_done_callback(lambda _: self._inflight.release())
        return future

    def synchronize(self) -> None:
        """Wait until every copy/write started so far has landed (device memory then released)."""
        if self._io is not None:
            self._io.submit(lambda: None).result()  # one worker: everything queued before is done
        if self._stream is not None:
            self._stream.synchronize()
        self.poll()

    def close(self) -> None:
        """Wait for outstanding I/O and remove the offload directory it created."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self._own_dir and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _contiguous_stride(shape: torch.Size) -> tuple:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))
