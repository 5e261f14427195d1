"""Activation offload through saved-tensor hooks: host (pinned pool) or disk, asynchronous, prefetched.

:class:`ActivationOffloader` is a packer of :mod:`.hooks`: a tensor autograd saves inside an offloaded scope
is copied off the device on a side stream (:mod:`.streams` states the stream contract), and the offloader
keeps no reference to the device copy (``record_stream`` guards it until the copy has landed), so the device
memory is released then, whoever calls what; at most ``offload_max_inflight`` copies are pending.  In
backward the first unpack of a layer's tensors fetches that whole layer and starts fetching the layer
before it in the same model chunk.  A tensor is offloaded once per *storage*; parameters (and views of
them) and tensor subclasses never are; a tensor past the host pool's bound stays where it is and is
counted (:class:`OffloadStats`), never an out-of-memory error.
Policies, what is offloaded and what is counted: docs/memory-features.md (``--longctx-offload-*``).
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
from megatron_longctx.memory.offload_disk import RunDir, default_root
from megatron_longctx.memory.offload_store import Resources, SavedView, Stored

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
    """Packer for :mod:`megatron_longctx.memory.hooks` that offloads by policy (``MemoryConfig.offload_policy``:
    ``checkpoint``, ``modules`` or ``layers``, docs/memory-features.md).

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
    def pack(self, t: torch.Tensor, prefetchable: bool = True) -> Optional[SavedView]:
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
        return SavedView(stored, t.dtype, tuple(t.shape), stride, offset)

    def pack_rows(self, t: torch.Tensor) -> Optional[SavedView]:
        """:meth:`pack` for a tensor read back a row range at a time (:meth:`unpack_rows`): contiguous,
        and never prefetched whole (a neighbour layer's unpack would bring it back all at once)."""
        if not t.is_contiguous() or t.dim() == 0:  # contiguous: row i is elements [i·row, (i+1)·row) from its offset
            return None
        return self.pack(t, prefetchable=False)

    def unpack_rows(self, view: SavedView, lo: int, hi: int, ahead: Optional[tuple] = None) -> torch.Tensor:
        """Rows ``[lo, hi)`` of the tensor :meth:`pack_rows` packed, read back alone; ``ahead``: the rows
        ``(lo, hi)`` read next, whose copy starts now (:meth:`Stored.get_range`)."""
        row = math.prod(view.size[1:])
        esize = torch.empty(0, dtype=view.dtype).element_size()

        def byte_range(lo: int, hi: int) -> tuple[int, int]:
            return (view.offset + lo * row) * esize, (hi - lo) * row * esize

        start, nbytes = byte_range(lo, hi)
        data = view.stored.get_range(start, nbytes, None if ahead is None else byte_range(*ahead))  # [nbytes] uint8
        self.stats.fetched_bytes += nbytes
        self.stats.row_fetches += 1
        return data.view(view.dtype).view(hi - lo, *view.size[1:])

    def wait_stored(self, view: SavedView) -> None:
        """Return once the bytes :meth:`pack` took are off the tensor's memory (the copy or the file write
        has read them), so that memory may be overwritten; a failed write raises here."""
        stored = view.stored
        if stored._copied is not None:  # a device tensor: later work on the compute stream follows the copy
            self.ops.wait_event(self.ops.current(stored.device), stored._copied)
        elif stored.write is not None:  # a CPU tensor the I/O worker writes to its file
            stored.write.result()

    def unpack(self, view: SavedView) -> torch.Tensor:
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
    def _shared_storage(self, t: torch.Tensor, storage: Any) -> Optional[Stored]:
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

    def _offload(self, src: torch.Tensor, prefetchable: bool = True) -> Optional[Stored]:
        """Start moving ``src`` ([n] uint8) off the device; None when the host pool is full."""
        group = (self._microbatch, hooks.current_layer())
        nbytes = src.numel()
        stored = Stored(self, src, group)
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
        weakref.finalize(stored, Resources.release, Resources(
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
