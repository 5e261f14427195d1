"""Activation offload through saved-tensor hooks: host (pinned pool) or disk, asynchronous, prefetched.

Forward: a tensor autograd saves inside an offloaded scope is copied off the device on a side CUDA
stream (:mod:`.streams` states the exact stream contract); the offloader keeps no reference to the
device copy, and ``record_stream`` keeps the caching allocator from reusing it before the copy has
landed, so the device memory is released then, whoever calls what.  At most ``offload_max_inflight``
copies are pending: the next one waits for the oldest, which bounds the device memory waiting on
copies across layers, micro-batches and steps.  The last layer of a micro-batch is no exception: its
device copies are gone before backward, which brings back one copy.  Disk: the device copy is staged
through a pinned pool buffer on the side stream and an I/O worker writes it (:mod:`.offload_disk`).

Backward: the first unpack of a layer's tensors fetches that whole layer and starts fetching the
layer before it in the same model chunk (backward runs layers in reverse; a virtual-pipeline chunk's
first layer never prefetches the previous chunk's last layer, whose backward is scheduled elsewhere).
Restored buffers are allocated on the compute stream, like the tensors autograd would have kept.
Ideas from ALST (checkpoint offload, arXiv:2506.13996) and Megatron/TE activation offloading
(NVIDIA/Megatron-LM), rebuilt without Transformer Engine, with recompute and PP.

Policies (``MemoryConfig.offload_policy``): ``checkpoint`` — only what a full-recompute layer keeps, its
input; ``modules`` — tensors saved inside named modules; ``layers`` — everything saved in the first N
layers.  Parameters are never offloaded (nor views of them: their storage addresses are re-read at
every micro-batch, so ``.cuda()`` after CPU initialisation or a DDP parameter buffer is seen), nor
tensor subclasses (FP8 weights, DTensor...: counted as ``subclass_kept_bytes``).  A tensor is offloaded
per *storage*: views of one storage (and a tensor several layers save, like RoPE tables) travel once.
The host pool is bounded (cached buffers included): a tensor past the bound stays where it is and is
counted, never an out-of-memory error.  On a CPU-only process ``host`` cannot lower memory (the
tensor already lives in host memory): such tensors are left in place and counted as
``host_noop_bytes``; ``disk`` is what lowers resident memory there.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import math
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Optional, Union

import torch

from megatron_longctx.config import MemoryConfig
from megatron_longctx.kernels.cuda_presence import unusable_gpu_reason
from megatron_longctx.memory import hooks, streams
from megatron_longctx.memory.host_pool import HostPool
from megatron_longctx.memory.offload_disk import RunDir, default_root, read_file, remove_file, write_file

_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclasses.dataclass
class OffloadStats:
    """Byte counters of one offloader (all since construction)."""

    offloaded_bytes: int = 0
    offloaded_tensors: int = 0
    deduplicated_bytes: int = 0  # views / shared tensors that reused a storage already offloaded
    kept_over_bound_bytes: int = 0  # the host pool was full: left on the device
    host_noop_bytes: int = 0  # target host but the tensor is already in host memory
    subclass_kept_bytes: int = 0  # tensor subclasses (FP8, DTensor...) are left to autograd
    fetched_bytes: int = 0
    row_fetches: int = 0  # row ranges read back alone (a layer replayed in sequence tiles)
    prefetched_groups: int = 0
    waited_copies: int = 0  # copies the offloader waited for because offload_max_inflight were pending
    param_refreshes: int = 0  # parameter address sets read (first use and after parameters moved)
    residual_grad_bytes: int = 0  # streamed residual-gradient rows moved, both ways (:mod:`.residual_offload`)


class _Stored:
    """One storage's bytes off the device: where they are and how to bring them back."""

    def __init__(self, offloader: "ActivationOffloader", src: torch.Tensor, group: tuple) -> None:
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
class _Resources:
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


def _write_staged(off: "ActivationOffloader", event: Any, staging: torch.Tensor, path: str) -> None:
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
class _View:
    """How to rebuild the saved tensor from its storage's bytes."""

    stored: _Stored
    dtype: torch.dtype
    size: tuple
    stride: tuple
    offset: int  # in elements of ``dtype``


ParamSource = Union[Iterable[torch.Tensor], Callable[[], Iterable[torch.Tensor]]]


def _storage_ptrs(t: torch.Tensor) -> list[int]:
    """Storage addresses of a parameter; a wrapper subclass (e.g. FP8) gives those of its inner tensors."""
    if type(t) not in _PLAIN and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [p for name in names for p in _storage_ptrs(getattr(t, name))]
    try:
        return [t.untyped_storage().data_ptr()]
    except (RuntimeError, NotImplementedError):  # no storage of its own (a subclass without flattening)
        return []


class ActivationOffloader:
    """Packer for :mod:`megatron_longctx.memory.hooks` that offloads by policy; see module docstring.

    The model wiring (:func:`megatron_longctx.megatron.memory_spec.install`) opens :func:`hooks.layer_scope` around
    each transformer layer, :func:`hooks.module_scope` around named submodules, and calls
    :meth:`next_microbatch` at every new forward of the first layer of each model chunk, so that
    pipeline schedules with several micro-batches in flight key their tensors apart.

    ``params``: the parameters (or a function returning them, re-read at every micro-batch).
    ``chunk_starts``: indices of the layers that begin a model chunk (virtual pipeline stages).
    """

    def __init__(self, cfg: MemoryConfig, params: ParamSource = (), num_layers: int = 0,
                 chunk_starts: Iterable[int] = (0,), ops: Any = None) -> None:
        if not cfg.offload_enabled:
            raise ValueError("--longctx-offload-policy: is 'none'; choose checkpoint, modules or layers to offload")
        self.cfg, self.stats = cfg, OffloadStats()
        self.ops = ops if ops is not None else streams.device_ops()
        self.pool = HostPool(cfg.offload_host_pool_bytes)
        self.pending: collections.deque = collections.deque()  # events of copies not known to have landed
        self._params = params if callable(params) else tuple(params)
        self._param_ptrs: Optional[frozenset] = None  # read at the first use and every micro-batch
        self._num_layers = num_layers
        self._chunk_starts = frozenset(chunk_starts)
        self._microbatch = 0
        self._groups: dict[tuple, list[weakref.ref]] = {}
        self._shared: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self._streams: dict = {}
        self._io: Optional[cf.ThreadPoolExecutor] = None
        self._io_error: Optional[BaseException] = None
        self._inflight = threading.BoundedSemaphore(cfg.offload_max_inflight)
        self._run_dir: Optional[RunDir] = None
        self._counter = 0
        if cfg.offload_target == "host" and ops is None and not torch.cuda.is_available():
            reason = unusable_gpu_reason()
            if reason is not None:
                warnings.warn(f"--longctx-offload-target host lowers no memory on the CPU, and {reason}",
                              RuntimeWarning, stacklevel=2)
        if cfg.offload_target == "disk":
            self._run_dir = RunDir(default_root(cfg))
            self._io = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="longctx-offload-io")

    @property
    def disk_dir(self) -> Optional[str]:
        """This offloader's run directory (disk target), removed by :meth:`close`."""
        return self._run_dir.path if self._run_dir is not None else None

    def next_microbatch(self) -> None:
        """Start keying tensors under a new micro-batch (and forget the storage-sharing table)."""
        self._microbatch += 1
        self._shared.clear()
        self._groups = {g: refs for g, refs in self._groups.items() if any(r() is not None for r in refs)}
        self._param_ptrs = None  # parameters may have moved (.cuda(), a DDP buffer) since the last one
        self.poll()

    # -- policy ----------------------------------------------------------------------------------
    def _params_ptrs(self) -> frozenset:
        if self._param_ptrs is None:
            params = self._params() if callable(self._params) else self._params
            self._param_ptrs = frozenset(p for t in params for p in _storage_ptrs(t))
            self.stats.param_refreshes += 1
        return self._param_ptrs

    def _wanted(self, t: torch.Tensor) -> bool:
        layer = hooks.current_layer()
        if layer is None or isinstance(t, torch.nn.Parameter):
            return False
        if t.numel() * t.element_size() < self.cfg.offload_min_bytes:
            return False
        if type(t) not in _PLAIN:
            self.stats.subclass_kept_bytes += t.numel() * t.element_size()
            return False
        if t.untyped_storage().data_ptr() in self._params_ptrs():  # views of parameters (weight.t())
            return False
        policy = self.cfg.offload_policy
        if policy == "modules":
            return any(m in self.cfg.offload_modules for m in hooks.current_modules())
        if policy == "layers":
            return self.cfg.offload_num_layers == 0 or layer < self.cfg.offload_num_layers
        return True  # checkpoint: the wiring opens layer scopes only around checkpointed layers

    # -- packer protocol -------------------------------------------------------------------------
    def pack(self, t: torch.Tensor, prefetchable: bool = True) -> Optional[_View]:
        if not self._wanted(t):
            return None
        if self.cfg.offload_target == "host" and not self.ops.is_device(t):
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
            stored = self._offload(src, prefetchable)
            del src  # the offloader keeps no reference to the device copy
            if stored is None:
                return None
            if whole:
                owner = t._base if t._base is not None else t  # a view's Python object may be a temporary
                self._shared[storage.data_ptr()] = (weakref.ref(owner), weakref.ref(stored), owner._version)
            offset = t.storage_offset() if whole else 0
            stride = tuple(t.stride()) if whole else _contiguous_stride(t.shape)
        else:
            self.stats.deduplicated_bytes += t.numel() * t.element_size()
            offset, stride = t.storage_offset(), tuple(t.stride())
        return _View(stored, t.dtype, tuple(t.shape), stride, offset)

    def pack_rows(self, t: torch.Tensor) -> Optional[_View]:
        """:meth:`pack` for a tensor read back a row range at a time (:meth:`unpack_rows`): contiguous,
        and never prefetched whole (a neighbour layer's unpack would bring it back all at once)."""
        if not t.is_contiguous() or t.dim() == 0:  # contiguous: row i is elements [i·row, (i+1)·row) from its offset
            return None
        return self.pack(t, prefetchable=False)

    def unpack_rows(self, view: _View, lo: int, hi: int, ahead: Optional[tuple] = None) -> torch.Tensor:
        """Rows ``[lo, hi)`` of the tensor :meth:`pack_rows` packed, read back alone; ``ahead``: the rows
        ``(lo, hi)`` read next, whose copy starts now (:meth:`_Stored.get_range`)."""
        row = math.prod(view.size[1:])
        esize = torch.empty(0, dtype=view.dtype).element_size()

        def byte_range(lo: int, hi: int) -> tuple[int, int]:
            return (view.offset + lo * row) * esize, (hi - lo) * row * esize

        start, nbytes = byte_range(lo, hi)
        data = view.stored.get_range(start, nbytes, None if ahead is None else byte_range(*ahead))  # [nbytes] uint8
        self.stats.fetched_bytes += nbytes
        self.stats.row_fetches += 1
        return data.view(view.dtype).view(hi - lo, *view.size[1:])

    def wait_stored(self, view: _View) -> None:
        """Return once the bytes :meth:`pack` took are off the tensor's memory (the copy or the file write
        has read them), so that memory may be overwritten; a failed write raises here."""
        stored = view.stored
        if stored._copied is not None:  # a device tensor: later work on the compute stream follows the copy
            self.ops.wait_event(self.ops.current(stored.device), stored._copied)
        elif stored.write is not None:  # a CPU tensor the I/O worker writes to its file
            stored.write.result()

    def unpack(self, view: _View) -> torch.Tensor:
        stored = view.stored
        if self.cfg.offload_prefetch:
            self._prefetch_group(stored.group)
            layer = stored.group[1]
            if layer is not None and layer > 0 and layer not in self._chunk_starts:
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
        ref, stored_ref, version = entry
        alive, stored = ref(), stored_ref()
        # the stored bytes are this storage's only while its owner lives unmodified (an in-place write since,
        # such as a tiled layer's output over its input, makes them another tensor's)
        if (alive is None or stored is None or alive.untyped_storage().data_ptr() != storage.data_ptr()
                or alive._version != version):
            del self._shared[storage.data_ptr()]
            return None
        return stored

    def _offload(self, src: torch.Tensor, prefetchable: bool = True) -> Optional[_Stored]:
        """Start moving ``src`` ([n] uint8) off the device; None when the host pool is full."""
        group = (self._microbatch, hooks.current_layer())
        nbytes = src.numel()
        stored = _Stored(self, src, group)
        staged = self.cfg.offload_target == "host" or stored.on_device
        host = self.pool.take(nbytes) if staged else None
        if staged and host is None:
            self.stats.kept_over_bound_bytes += nbytes
            return None
        if self.cfg.offload_target == "host":
            stored.start_to_host(src, host)
        else:
            assert self._run_dir is not None
            self._counter += 1
            path = os.path.join(self._run_dir.path, f"mb{group[0]}-l{group[1]}-{self._counter}.bin")
            stored.start_to_disk(src, path, host)
        weakref.finalize(stored, _Resources.release, _Resources(
            self.pool if stored.host_from_pool else None, stored.host_buffer, stored.path, stored.write))
        if prefetchable:
            self._groups.setdefault(group, []).append(weakref.ref(stored))
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

    # -- copies on the side stream (the stream contract of :mod:`.streams`) ---------------------------
    def copy_to_host(self, host: torch.Tensor, src: torch.Tensor) -> Any:
        """Start copying device ``src`` into ``host`` (pinned) on the side stream once the compute stream
        has made it; returns the copy's event.  ``src`` may be dropped at once (``record_stream``)."""
        ops, side = self.ops, self.side_stream(src.device)
        ops.wait_stream(side, ops.current(src.device))  # the copy reads the finished tensor
        with ops.use(side):
            ops.copy(host, src)
            event = ops.record_event(side)
        ops.record_stream(src, side)  # its memory is not reused before the copy has landed
        self.track_copy(event)
        return event

    def rows_to_device(self, host: torch.Tensor, device: torch.device, after: Any = None) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` (``[n]`` uint8) into a new buffer on ``device``: (buffer, event).

        The buffer is a side-stream allocation, so the copy waits for no compute-stream work (only for
        ``after``, the event of the copy that filled ``host``, if any); :meth:`rows_ready` hands it over."""
        ops, side = self.ops, self.side_stream(device)
        with ops.use(side):
            buf = ops.empty(host.numel(), device)  # [n] uint8
            if after is not None:
                ops.wait_event(side, after)
            ops.copy(buf, host)
            event = ops.record_event(side)
        return buf, event

    def rows_ready(self, buf: torch.Tensor, event: Any) -> torch.Tensor:
        """``buf`` from :meth:`rows_to_device` for the compute stream: it waits for that copy alone, and
        the side stream does not reuse the memory before the compute stream is done with it."""
        compute = self.ops.current(buf.device)
        self.ops.wait_event(compute, event)
        self.ops.record_stream(buf, compute)
        return buf

    def track_copy(self, event: Any) -> None:
        """A device-to-host copy was queued: forget the landed ones, wait for the oldest past the bound."""
        self.poll()
        self.pending.append(event)
        while len(self.pending) > self.cfg.offload_max_inflight:
            self.ops.sync_event(self.pending.popleft())
            self.stats.waited_copies += 1

    def poll(self) -> None:
        """Forget copies that have landed (optional: device copies are released without it)."""
        while self.pending and self.ops.done(self.pending[0]):  # one side stream: they land in order
            self.pending.popleft()

    def side_stream(self, device: torch.device) -> Any:
        key = str(device)
        if key not in self._streams:
            self._streams[key] = self.ops.new_stream(device)
        return self._streams[key]

    def submit_io(self, fn: Any, *args: Any) -> cf.Future:
        """Run ``fn`` on the I/O worker with at most ``offload_max_inflight`` jobs queued."""
        assert self._io is not None
        if self._io_error is not None:
            raise self._io_error
        self._inflight.acquire()
        future = self._io.submit(fn, *args)
        future.add_done_callback(self._io_done)
        return future

    def _io_done(self, future: cf.Future) -> None:
        self._inflight.release()
        if not future.cancelled() and future.exception() is not None and self._io_error is None:
            self._io_error = future.exception()  # raised in the training thread at the next offload

    def synchronize(self) -> None:
        """Wait until every copy/write started so far has landed (device memory then released)."""
        if self._io is not None:
            self._io.submit(lambda: None).result()  # one worker: everything queued before is done
        for stream in self._streams.values():
            self.ops.sync_stream(stream)
        self.pending.clear()
        if self._io_error is not None:
            raise self._io_error

    def close(self) -> None:
        """Wait for outstanding I/O and remove this offloader's run directory."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self._run_dir is not None:
            self._run_dir.remove()
        self.pool.clear()


def _contiguous_stride(shape: torch.Size) -> tuple:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))
