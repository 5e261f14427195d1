"""Model states off the device: each unit's weights come into a device slot for its use, its gradients leave.

A *unit* is a module whose parameters move together (a transformer layer, the embedding, the output layer).
Between uses the off-device copy is the truth: a host buffer from the bounded
:class:`~megatron_longctx.memory.host_pool.HostPool` (``host``, so activations and model states share one
bound) or a file on local disk read back through a pool buffer (``disk``).  :class:`ModelStateStreamer`
runs on module hooks: a unit's forward pre-hook brings its weights into a weight slot (and starts the next
unit's on their way), the post-hook points ``.data`` back at the off-device copy; a gradient hook on the
unit's outputs brings the weights in again for its backward, with a gradient slot as ``main_grad`` that
leaves for the off-device accumulator once every parameter has its gradient.  A unit holds no slot after
its use (:meth:`ModelStateStreamer.check_released`).
What is built, tested and measured: docs/model-state-offload.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any, Iterator, Optional, Sequence

import torch

from megatron_longctx.memory import hooks
from megatron_longctx.memory.model_state_store import (FLAG, ModelStateError, OffDeviceStore,  # noqa: F401
                                                       StreamOptions)
from megatron_longctx.memory.model_state_units import Unit, add_bytes, tensors, view
from megatron_longctx.memory.offload_disk import DiskOffloadError, read_file

class ModelStateStreamer(OffDeviceStore):
    """Streams ``units``' weights in and their gradients out.

    The device holds ``opts.slots`` weight slots and as many gradient slots, each sized for the largest
    unit.  On the CPU the "device" is the CPU: the slots are still distinct tensors and every copy still
    happens, so :attr:`resident` (the bytes of parameters and gradients in device slots) is the real cost,
    and :meth:`check_released` fails if a unit's weights stay in a slot after its use.
    """

    def __init__(self, units: Sequence[torch.nn.Module], opts: StreamOptions) -> None:
        if opts.slots < 2:
            raise ModelStateError(f"{FLAG}: needs at least two device slots (one in use, one being filled)")
        super().__init__(units, opts)
        self.slot_bytes = max(u.nbytes for u in self.units)
        self.gslot_bytes = max(u.gbytes for u in self.units)
        dev = opts.device
        self.wslots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=dev) for _ in range(opts.slots)]
        self.gslots = [torch.empty(self.gslot_bytes, dtype=torch.uint8, device=dev) for _ in range(opts.slots)]
        self._wowner: list = [None] * opts.slots
        self._gowner: list = [None] * opts.slots
        self._slot_ptrs = {s.untyped_storage().data_ptr(): i for i, s in enumerate(self.wslots)}
        # GPU: copies run on a side stream; a slot is written only after the compute stream's last use of it
        self._side = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        self._wfree: list = [None] * opts.slots  # event: the compute stream is done with the weight slot
        self._gfree: list = [None] * opts.slots  # event: the gradient slot's copy out has read it
        self.resident = 0  # bytes of parameters and gradients now in device slots
        self.peak_resident = 0
        self.loads = self.grad_flushes = self.prefetches = self.evictions = 0  # evictions: of units held ahead
        self.bytes_in = self.bytes_out = 0  # weights copied into slots; gradients copied out of them
        self.sync_grads = True  # False for all but a step's last micro-batch (as DDP's no_sync)
        # the distributed optimizer's partition (model_state_shards.Shards): gradients reduce-scattered over it
        self.shards: Any = None
        self.scratch_allocations = 0  # reduce-scatters that found no idle weight slot
        # disk: the next unit's weights read ahead on a reader thread (one read in flight)
        self._ahead = self._take(self.slot_bytes, "the disk read-ahead buffer") if opts.target == "disk" else None
        self._ahead_read: Optional[tuple[int, concurrent.futures.Future]] = None  # (unit index, its read)
        self._ahead_free: Any = None  # GPU: event of the last copy out of the read-ahead buffer
        self._reader: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.reads_ahead_used = 0  # loads served from the read-ahead buffer
        self._forward_ctx: list = []
        self._handles: list = []
        self._install_hooks()

    # ------------------------------------------------------------------ placement
    @property
    def capacity(self) -> int:
        """Bytes the device slots hold: the bound on :attr:`resident`."""
        return len(self.wslots) * self.slot_bytes + len(self.gslots) * self.gslot_bytes

    # ------------------------------------------------------------------ weights in and out
    def _free_slot(self, owners: list) -> Optional[int]:
        for i, owner in enumerate(owners):
            if owner is None:
                return i
        return None

    def _load(self, u: Unit, prefetch: bool = False) -> None:
        """``u``'s weights into a weight slot (if not there yet) and, unless this is a ``prefetch``, its
        parameters pointed at them."""
        if u.wslot is None:
            slot = self._free_slot(self._wowner)
            if slot is None:
                slot = self._evict_prefetched()
            if slot is None:
                raise ModelStateError(f"{FLAG}: no free device slot for unit {u.index} (units in slots: "
                                      f"{[o.index for o in self._wowner if o is not None]})")
            self._wowner[slot], u.wslot = u, slot
            dst = self.wslots[slot][:u.nbytes]
            if u.host is not None:
                with self._on_side(self._wfree[slot]):
                    dst.copy_(u.host, non_blocking=True)
                    u.ready = self._side.record_event() if self._side is not None else None
            else:  # on the compute stream, behind the slot's last use
                assert u.path is not None and self._staging is not None
                ahead = self._read_ahead_of(u)
                if ahead is None:
                    dst.copy_(self._read(u.path, u.nbytes, f"unit {u.index}'s weights"))
                else:
                    dst.copy_(ahead, non_blocking=True)
                    self._ahead_free = self._compute_event()
                    self.reads_ahead_used += 1
            self._charge(u.nbytes)
            self.loads += 1
            self.bytes_in += u.nbytes
            u.prefetched = prefetch
        if prefetch:
            return
        u.prefetched = False
        self._wait(u.ready)
        u.ready = None
        buf = self.wslots[u.wslot]
        for p in u.params:
            p.param.data = view(buf, p.offset, p.dtype, p.shape)

    def _prefetch(self, index: int) -> None:
        """Start unit ``index``'s weights on their way ahead of its use: ``host``, into a free slot; ``disk``,
        its file into the read-ahead buffer on the reader thread (when no other read is in flight)."""
        if not 0 <= index < len(self.units) or self.units[index].wslot is not None:
            return
        u = self.units[index]
        if self.opts.target == "host" and None in self._wowner:
            self._load(u, prefetch=True)
            self.prefetches += 1
        elif self.opts.target == "disk" and self._ahead_read is None:
            self._start_read_ahead(u)
            self.prefetches += 1

    def _start_read_ahead(self, u: Unit) -> None:
        assert self._ahead is not None and u.path is not None
        if self._reader is None:
            self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="longctx-model-states")
        free, out, path = self._ahead_free, self._ahead[:u.nbytes], u.path

        def read() -> torch.Tensor:
            if free is not None:  # the last copy out of the buffer has read it
                free.synchronize()
            return read_file(path, u.nbytes, 0, out)

        self._ahead_read = (u.index, self._reader.submit(read))

    def _read_ahead_of(self, u: Unit) -> Optional[torch.Tensor]:
        """``u``'s weights from the read-ahead buffer once its read is done; None when its read is not the one
        in flight (that read goes on)."""
        if self._ahead_read is None or self._ahead_read[0] != u.index:
            return None
        _, read = self._ahead_read
        self._ahead_read = None
        try:
            return read.result()
        except DiskOffloadError as exc:
            raise ModelStateError(f"{FLAG} disk: reading unit {u.index}'s weights ({u.nbytes} bytes) failed: "
                                  f"{exc}") from exc

    def _settle_reads(self) -> None:
        """Wait for a read ahead in flight and drop it (its unit's file is about to change, or the pass ended)."""
        if self._ahead_read is not None:
            _, read = self._ahead_read
            self._ahead_read = None
            with contextlib.suppress(DiskOffloadError):  # a use would read the file again and report it
                read.result()

    def _evict_prefetched(self) -> Optional[int]:
        for u in self._wowner:
            if u is not None and u.prefetched:
                slot = u.wslot
                self._release(u)
                self.evictions += 1
                return slot
        return None

    @contextlib.contextmanager
    def _on_side(self, after: Any) -> Iterator[None]:
        """Queue the block's copies on the side stream (GPU), behind ``after``, an event of the compute stream
        (None: nothing to wait for)."""
        if self._side is None:
            yield
            return
        if after is not None:
            self._side.wait_event(after)
        with torch.cuda.stream(self._side):
            yield

    def _wait(self, event: Any) -> None:
        """The compute stream waits for ``event`` (a side-stream copy); nothing to wait for on the CPU."""
        if event is not None:
            torch.cuda.current_stream(self.opts.device).wait_event(event)

    def _compute_event(self) -> Any:
        return torch.cuda.current_stream(self.opts.device).record_event() if self._side is not None else None

    def _release(self, u: Unit) -> None:
        if u.wslot is None:
            return
        self._wfree[u.wslot] = self._compute_event()
        self._wowner[u.wslot], u.wslot = None, None
        u.prefetched, u.ready = False, None
        self._charge(-u.nbytes)
        self._point_off_device(u)

    @contextlib.contextmanager
    def idle_slots(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Two weight slots lent as scratch between passes (the distributed optimizer's all-gathers,
        :class:`~megatron_longctx.memory.model_state_shards.Shards`): a unit held ahead is dropped first; a unit
        in use is an error.  The compute stream uses them; the next load into them waits for that use."""
        while self._evict_prefetched() is not None:
            pass
        busy = [u.index for u in self._wowner if u is not None]
        if busy:
            raise ModelStateError(f"{FLAG}: the weight slots are lent between passes, but units {busy} hold theirs")
        if self._side is not None:  # a copy into a slot queued on the side stream is done before the use
            torch.cuda.current_stream(self.opts.device).wait_stream(self._side)
        try:
            yield self.wslots[0], self.wslots[1]
        finally:
            self._wfree[0] = self._wfree[1] = self._compute_event()

    def _charge(self, n: int) -> None:
        self.resident += n
        self.peak_resident = max(self.peak_resident, self.resident)
        assert self.resident <= self.capacity, (self.resident, self.capacity)

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self) -> None:
        for u in self.units:
            for m in u.modules:
                self._handles.append(m.register_forward_pre_hook(
                    lambda _m, args, kwargs, u=u: self._pre_forward(u, (args, kwargs)), with_kwargs=True))
                self._handles.append(m.register_forward_hook(  # also when forward raises: the packer leaves
                    lambda _m, _a, out, u=u: self._post_forward(u, out), always_call=True))
            for p in u.params:
                if p.goffset >= 0:
                    self._handles.append(p.param.register_post_accumulate_grad_hook(
                        lambda param, u=u: self._grad_ready(u, param)))

    def _pre_forward(self, u: Unit, inputs: tuple) -> None:
        """Forward pre-hook: ``u``'s weights into a free weight slot, each parameter's ``.data`` pointed at its
        view there, and the next unit of this pass started (:meth:`_prefetch`).  A recompute re-enters the
        same hooks, so the weights come in again for it."""
        # first what the post-hook undoes, which runs also when this hook raises (a weight file unreadable)
        u.in_forward += 1
        ctx = hooks.packing(_SlotViewPacker(self))
        ctx.__enter__()
        # the inputs' autograd nodes: an input handed back untouched (a norm passed through) is no output of
        # the unit's weights; one written in place (an output over its input) has a new node
        self._forward_ctx.append((ctx, {id(t): t.grad_fn for t in tensors(inputs)}))
        self._load(u)
        # the next unit in this pass: a recompute inside backward walks the units backwards
        self._prefetch(u.index - 1 if torch._C._current_graph_task_id() >= 0 else u.index + 1)

    def _post_forward(self, u: Unit, out: Any) -> None:
        """Forward post-hook: ``.data`` pointed back at the off-device copy and the slot freed (after a
        recompute the unit stays for its backward unless a load needs its slot), and a gradient hook put on
        the outputs, which starts the unit's backward."""
        ctx, given = self._forward_ctx.pop()
        ctx.__exit__(None, None, None)
        if torch.is_grad_enabled():  # the unit's backward starts when a gradient reaches one of its outputs
            for t in tensors(out):
                if t.requires_grad and t.grad_fn is not None and given.get(id(t), object()) is not t.grad_fn:
                    t.register_hook(lambda g, u=u: self._pre_backward(u))
        u.in_forward -= 1
        if not u.in_forward and u.gslot is None:
            if torch._C._current_graph_task_id() >= 0:  # a recompute: the unit's backward comes next
                u.prefetched = True  # stays unless a load needs its slot first
            else:
                self._release(u)

    def _pre_backward(self, u: Unit) -> None:
        """The gradient hook on ``u``'s outputs: its weights in again for its backward, and each parameter's
        ``main_grad`` (Megatron's gradient protocol) pointed at a zeroed view of a gradient slot."""
        if u.gslot is not None:  # another output of the unit got there first
            return
        self._load(u)
        self._prefetch(u.index - 1)
        if u.gslot is None and u.gbytes:
            slot = self._free_slot(self._gowner)
            if slot is None:
                raise ModelStateError(f"{FLAG}: no free gradient slot for unit {u.index}")
            self._gowner[slot], u.gslot = u, slot
            self._charge(u.gbytes)
            gbuf = self.gslots[slot][:u.gbytes].view(torch.uint8)
            self._wait(self._gfree[slot])
            gbuf.zero_()
            for p in u.params:
                if p.goffset >= 0:
                    p.param.main_grad = view(gbuf, p.goffset, p.grad_dtype, p.shape)
            u.pending = {id(p.param) for p in u.params if p.goffset >= 0}

    def _grad_ready(self, u: Unit, param: torch.Tensor) -> None:
        """A gradient autograd hands ``param`` (``.grad``) is added into ``main_grad``; once every parameter of
        ``u`` has its gradient, the slot is added into the off-device accumulator (:meth:`_flush`)."""
        if self.opts.accumulate_grad and param.grad is not None:
            # Megatron's gradient-accumulation-fusion protocol: a backward that added into main_grad itself
            # hands autograd an unread placeholder and sets grad_added_to_main_grad
            if not getattr(param, "grad_added_to_main_grad", False):
                param.main_grad.add_(param.grad)
            param.grad = None
        u.pending.discard(id(param))
        if not u.pending and u.gslot is not None:
            self._flush(u)

    def _flush(self, u: Unit) -> None:
        """``u``'s gradient slot added into its off-device accumulator; both its slots freed."""
        assert u.gslot is not None
        gbuf = self.gslots[u.gslot][:u.gbytes]
        group = self.opts.reduce_group
        if self.sync_grads and group is not None and torch.distributed.get_world_size(group) > 1:
            self._reduce(u, gbuf, group)
            return
        self._accumulate(u, gbuf)
        self._done(u)

    def _reduce(self, u: Unit, gbuf: torch.Tensor, group: Any) -> None:
        """A micro-batch with ``sync_grads``: the slot is summed over ``group`` (reduce-scattered with
        :attr:`shards`) and becomes the accumulator.  What earlier micro-batches accumulated joins it: before
        the sum where they ran under ``no_sync`` (local sums: one reduction per step, as DDP's), after it
        where each was summed as it ended (Megatron calls no ``no_sync`` without --overlap-grad-reduce)."""
        self._drain()
        acc = None
        if u.has_grad:
            acc = u.ghost if u.ghost is not None else self._read(u.gpath, u.gbytes, f"unit {u.index}'s gradients")
        grads = [view(gbuf, p.goffset, p.grad_dtype, p.shape) if p.goffset >= 0 else None for p in u.params]
        if acc is not None and not u.reduced:  # micro-batches under no_sync: local sums, reduced with this one
            add_bytes(u, gbuf, acc)
            acc = None
        if self.opts.grad_scale != 1.0:
            for g in grads:
                if g is not None:
                    g.mul_(self.opts.grad_scale)
        # every rank flushes its units in the same order: the collectives match
        if self.shards is not None and u.index not in self.opts.host_grad_units:
            for dtype in dict.fromkeys(g.dtype for g in grads if g is not None):
                with self._scratch(u) as scratch:
                    self.shards.reduce_scatter(u.index, [g if g is not None and g.dtype == dtype else None
                                                         for g in grads], scratch)
        else:  # whole (a tied embedding's copies are summed over the pipeline stages next, see keep_owned_grads)
            for g in grads:
                if g is not None:
                    torch.distributed.all_reduce(g, group=group)
        if acc is not None:  # earlier micro-batches, each reduced as it ended: their sum joins this one's
            add_bytes(u, gbuf, acc)
        u.reduced = True
        if u.ghost is not None:
            u.ghost.copy_(gbuf)
        else:
            assert self._staging is not None and u.gpath is not None
            self._staging[:u.gbytes].copy_(gbuf)
            self._write(self._staging[:u.gbytes], u.gpath, f"unit {u.index}'s gradients")
        self._done(u)

    @contextlib.contextmanager
    def _scratch(self, u: Unit) -> Iterator[torch.Tensor]:
        """A device buffer for ``u``'s reduce-scatter: its own weight slot, idle once every gradient of its
        backward is in and it is in no forward (the slot is released right after), else a free slot (one held
        ahead is dropped), else a buffer of a slot's size allocated for the call (counted)."""
        slot = u.wslot if not u.in_forward else None
        if slot is None:
            slot = self._free_slot(self._wowner)
        if slot is None:
            slot = self._evict_prefetched()
        if slot is None:
            self.scratch_allocations += 1
            yield torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.opts.device)
            return
        if slot != u.wslot and self._side is not None:  # a copy into it queued on the side stream ends first
            torch.cuda.current_stream(self.opts.device).wait_stream(self._side)
        yield self.wslots[slot]
        self._wfree[slot] = self._compute_event()  # the next load into the slot waits for this use

    def keep_owned_grads(self) -> None:
        """The distributed optimizer, before its step: the gradients of units summed whole (a tied
        embedding's, which Megatron sums over the pipeline stages after backward) zero outside this rank's
        range too, so every rank's norm counts each element once (:meth:`Shards.reduce_scatter`)."""
        if self.shards is None:
            return
        for index in self.opts.host_grad_units:
            self.shards.keep_owned(index, self.unit_grads(index))

    def _accumulate(self, u: Unit, gbuf: torch.Tensor) -> None:
        if u.reduced:
            raise ModelStateError(f"{FLAG}: unit {u.index}'s gradients were summed over the ranks at an earlier "
                                  "micro-batch of this step; a later one cannot skip the sum (no_sync must "
                                  "cover the step's first micro-batches, not its last)")
        if u.ghost is not None and self._side is not None:
            self._copy_out(u, gbuf)
            return
        if u.ghost is not None:
            add_bytes(u, u.ghost, gbuf)
        if u.gpath is not None:
            acc = self._staging
            assert acc is not None
            acc = acc[:u.gbytes]
            if u.has_grad:
                acc.copy_(self._read(u.gpath, u.gbytes, f"unit {u.index}'s gradients"))
                add_bytes(u, acc, gbuf)
            else:
                acc.copy_(gbuf)
            self._write(acc, u.gpath, f"unit {u.index}'s gradients")

    def _copy_out(self, u: Unit, gbuf: torch.Tensor) -> None:
        """GPU, host accumulator: what earlier micro-batches accumulated is added to the slot on the device,
        and the slot is copied over the accumulator on the side stream; the slot is reused, and the
        accumulator read, only after that copy."""
        assert u.ghost is not None and u.gslot is not None
        if u.has_grad:
            self._wait(u.copied_out)
            add_bytes(u, gbuf, u.ghost, non_blocking=True)
        with self._on_side(self._compute_event()):
            u.ghost.copy_(gbuf, non_blocking=True)
            u.copied_out = self._gfree[u.gslot] = self._side.record_event()
        self._copies_out.append(u.copied_out)

    def _done(self, u: Unit) -> None:
        assert u.gslot is not None
        u.has_grad = True
        self._gowner[u.gslot], u.gslot = None, None
        self._charge(-u.gbytes)
        self.grad_flushes += 1
        self.bytes_out += u.gbytes
        if not u.in_forward:
            self._release(u)

    def finish_backward(self) -> None:
        """Flush every unit whose backward did not reach all its parameters (unused parameters)."""
        for u in self.units:
            if u.gslot is not None:
                self._flush(u)
            if not u.in_forward:
                self._release(u)
        self._drain()
        self._settle_reads()  # the optimizer may rewrite the files next
        if self._side is not None:  # no weight copy still reads a host copy the optimizer is about to update
            self._side.synchronize()

    # ------------------------------------------------------------------ between steps
    def check_released(self) -> None:
        """Fail if any unit's weights or gradients are still in a device slot."""
        held = [u.index for u in self.units if u.wslot is not None or u.gslot is not None]
        for u in self.units:
            for p in u.params:
                if p.param.data.untyped_storage().data_ptr() in self._slot_ptrs:
                    held.append(u.index)
        if held or self.resident:
            raise AssertionError(f"units {sorted(set(held))} still hold device slots ({self.resident} bytes)")

    def describe(self) -> str:
        where = "pinned host pool" if self.opts.target == "host" else f"disk {self.run_dir.path}"
        return (f"model states of {len(self.units)} units on the {where}, "
                f"{len(self.wslots)} device slots of {self.slot_bytes} + {self.gslot_bytes} bytes")

    def _weights_change(self) -> None:
        self._settle_reads()

    def remove(self) -> None:
        self._settle_reads()
        if self._reader is not None:
            self._reader.shutdown()
            self._reader = None
        while self._forward_ctx:  # a forward that never reached its post hook
            self._forward_ctx.pop()[0].__exit__(None, None, None)
        while self._handles:
            self._handles.pop().remove()
        if self.run_dir is not None:
            self.run_dir.remove()


class _SlotViewPacker:
    """Saves a view of a weight in a slot (``weight.t()``) as a recipe on its parameter, so backward reads the
    weights then in the slot (a slot's later contents may be another unit's)."""

    def __init__(self, streamer: ModelStateStreamer) -> None:
        self.s = streamer

    def pack(self, t: torch.Tensor) -> Optional[Any]:
        if type(t) is not torch.Tensor or t.untyped_storage().data_ptr() not in self.s._slot_ptrs:
            return None  # a parameter, a tensor subclass (no storage of its own) or no view of a slot
        for u in self.s.units:
            if u.wslot is None:
                continue
            for p in u.params:
                d = p.param.data
                if (d.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() and d.dtype == t.dtype
                        and d.storage_offset() <= t.storage_offset() < d.storage_offset() + d.numel()):
                    return p.param, t.shape, t.stride(), t.storage_offset() - d.storage_offset()
        raise ModelStateError(f"{FLAG}: autograd saved a tensor in a weight slot that is no view of a parameter")

    def unpack(self, packed: Any) -> torch.Tensor:
        param, shape, stride, rel = packed
        d = param.data
        return d.as_strided(shape, stride, d.storage_offset() + rel)

