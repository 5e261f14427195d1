"""The off-device copies of streamed model states (:mod:`megatron_longctx.memory.model_states`): each unit's
weights and accumulated main gradients in the bounded host pool (``host``) or in files under a run directory
read and written through one staging buffer of the pool (``disk``), and what an optimizer step or a
checkpoint reads and writes there between steps, one unit at a time."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
from typing import Any, Iterator, Optional, Sequence

import torch

from megatron_longctx.memory.host_pool import HostPool
from megatron_longctx.memory.model_state_units import Unit, pack, view
from megatron_longctx.memory.offload_disk import DiskOffloadError, RunDir, read_file, write_file

FLAG = "--longctx-model-state-offload"
STASHED = "_longctx_stashed_weights"  # a module's attribute: its weights were written out as it was built


class ModelStateError(RuntimeError):
    """The model states cannot be placed or moved (the message names the flag, what and the fix)."""


@dataclasses.dataclass(frozen=True)
class Stashed:
    """Where :func:`stash_weights` wrote a module's weights, in the layout of the unit the module becomes."""

    run_dir: RunDir
    path: str
    params: tuple  # ids of the module's parameters, in the unit's order
    nbytes: int


def placeholder(param: torch.Tensor, device: Optional[torch.device] = None,
                dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A one-element tensor expanded to ``param``'s shape: what a parameter holds while its values are in a
    file (its shape, dtype and element count stay what Megatron reads)."""
    return torch.zeros(1, dtype=dtype or param.dtype, device=device or param.device).expand(param.shape)


def is_placeholder(t: Any) -> bool:
    """``t`` is a :func:`placeholder` (or a view of one): many elements over one element's storage."""
    return isinstance(t, torch.Tensor) and t.numel() > 1 and t.untyped_storage().nbytes() <= t.element_size()


def stash_weights(module: torch.nn.Module, run_dir: RunDir, name: str, dtype: Optional[torch.dtype] = None) -> None:
    """Write ``module``'s weights to a file under ``run_dir`` as the ``disk`` target lays out a unit, and leave
    :func:`placeholder` in its parameters, so that a model is never whole in memory while it is built: the
    :class:`OffDeviceStore` over it later takes the file as the unit's own (``module`` must be a unit by
    itself, e.g. a transformer layer).  ``dtype``: the parameters are cast to it first, as Megatron's
    ``Float16Module`` would after the build (its cast of a placeholder already of that dtype is a no-op)."""
    if dtype is not None:
        for p in module.parameters():
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
    u = Unit(-1, module, None)
    data = pack(u, torch.zeros(u.nbytes, dtype=torch.uint8))
    path = os.path.join(run_dir.path, f"{name}.w")
    _write_or_explain(data, path, f"{name}'s weights")
    for p in u.params:
        p.param.data = placeholder(p.param)
    setattr(module, STASHED, Stashed(run_dir, path, tuple(id(p.param) for p in u.params), u.nbytes))


def _write_or_explain(data: torch.Tensor, path: str, what: str) -> None:
    try:
        write_file(data.cpu() if data.device.type != "cpu" else data, path)
    except DiskOffloadError as exc:
        code = errno.errorcode.get(exc.errno or 0, "EIO")
        raise ModelStateError(
            f"{FLAG} disk: writing {what} ({data.numel()} bytes) to {path} failed: {code} ({os.strerror(exc.errno or errno.EIO)}); "
            f"free space under {os.path.dirname(path)}, point --longctx-offload-disk-dir at a larger disk, "
            f"or use {FLAG} host") from exc


@dataclasses.dataclass(frozen=True)
class StreamOptions:
    """How the model states are streamed.

    target: ``host`` or ``disk``.  device: where the slots live (the compute device).  pool: the host
    pool whose bound the off-device copies (``host``) or the staging buffers (``disk``) count against.
    disk_dir: the root of the run directory for ``disk``.  slots: weight slots (and gradient slots).
    grad_dtype: dtype of the main gradients (None: the parameter's).  accumulate_grad: add ``.grad``
    into ``main_grad`` here (False when Megatron's DDP hooks do it).  reduce_group: a process group (data
    parallel x context parallel) the gradient slot is summed over before it leaves the device.
    grad_scale: the factor the gradients are multiplied by before that sum (Megatron's DDP
    ``gradient_scaling_factor``, 1 / the group's size when the loss is not per token).
    host_grad_units: indices of units whose accumulated gradients others read and write on ``main_grad``
    between backward and the optimizer step (a tied embedding's copies on the first and last pipeline stage,
    summed by Megatron): with ``disk`` their accumulator stays in the host pool, their weights on disk.
    masters: with ``disk``, each unit's bf16/fp16 weights also have float32 master copies in a file of their
    own (what Megatron's mixed-precision optimizer steps; :meth:`OffDeviceStore.masters_in`), made from the
    weights as the states are placed, as Megatron makes its copies.
    """

    target: str
    device: torch.device
    pool: HostPool
    disk_dir: Optional[str] = None
    slots: int = 2
    grad_dtype: Optional[torch.dtype] = torch.float32
    accumulate_grad: bool = True
    reduce_group: Any = None
    grad_scale: float = 1.0
    host_grad_units: tuple = ()  # units whose gradient accumulator stays in the host pool with ``disk``
    masters: bool = False  # disk: float32 master copies of bf16/fp16 weights in a file per unit


class OffDeviceStore:
    """The units' off-device copies; :class:`~megatron_longctx.memory.model_states.ModelStateStreamer` adds the
    device slots and the hooks that stream them."""

    def __init__(self, units: Sequence[torch.nn.Module], opts: StreamOptions) -> None:
        if opts.target not in ("host", "disk"):
            raise ModelStateError(f"{FLAG}: unknown target {opts.target!r}; use one of host, disk")
        self.opts = opts
        self.units = [Unit(i, m, opts.grad_dtype) for i, m in enumerate(units)]
        self._by_param = {id(p.param): u for u in self.units for p in u.params}
        if len(self._by_param) != sum(len(u.params) for u in self.units):
            raise ModelStateError(f"{FLAG}: a parameter is shared by two units (tie them into one unit)")
        self.run_dir = RunDir(os.path.join(opts.disk_dir, "model-states")) if opts.target == "disk" else None
        self._staging: Optional[torch.Tensor] = None
        self._mstaging: Optional[torch.Tensor] = None  # one unit's float32 masters (disk, masters)
        self._copies_out: list = []  # GPU: events of gradient copies into the host accumulators not waited for
        self._place_off_device()

    def _take(self, nbytes: int, what: str) -> torch.Tensor:
        buf = self.opts.pool.take(nbytes)
        if buf is None:
            pool = self.opts.pool
            raise ModelStateError(
                f"{FLAG} {self.opts.target}: the host pool cannot hold {what} ({nbytes} bytes; bound "
                f"{pool.capacity}, in use {pool.used}): raise --longctx-offload-host-pool-bytes")
        return buf

    def _place_off_device(self) -> None:
        if self.opts.target == "disk":  # one staging buffer for the largest unit (weights or gradients)
            self._staging = self._take(max(max(u.nbytes, u.gbytes) for u in self.units), "the disk staging buffer")
            if self.opts.masters and any(u.mbytes for u in self.units):
                self._mstaging = self._take(max(u.mbytes for u in self.units), "the master weights' staging buffer")
        stash_dirs = {}
        for u in self.units:
            if self.opts.target == "host":
                u.host = self._take(u.nbytes, f"unit {u.index}'s weights")
            if u.gbytes and (self.opts.target == "host" or u.index in self.opts.host_grad_units):
                u.ghost = self._take(u.gbytes, f"unit {u.index}'s gradients")
                u.ghost.zero_()
            if self.opts.target == "disk":
                assert self.run_dir is not None
                u.path = os.path.join(self.run_dir.path, f"unit{u.index}.w")
                if u.ghost is None:
                    u.gpath = os.path.join(self.run_dir.path, f"unit{u.index}.g")
            stashed = self._stashed(u)
            if stashed is not None:  # written as the model was built: the file is the unit's
                stash_dirs[id(stashed.run_dir)] = stashed.run_dir
                if u.host is not None:
                    read_file(stashed.path, u.nbytes, 0, u.host)
                    os.remove(stashed.path)
                else:
                    os.replace(stashed.path, u.path)
                delattr(u.module, STASHED)
            else:
                dst = u.host if u.host is not None else self._staging
                assert dst is not None
                pack(u, dst)
                if u.path is not None:
                    self._write(dst[:u.nbytes], u.path, f"unit {u.index}'s weights")
            if self._mstaging is not None and u.mbytes:
                assert self.run_dir is not None
                u.mpath = os.path.join(self.run_dir.path, f"unit{u.index}.m")
                weights = self._read(u.path, u.nbytes, f"unit {u.index}'s weights") if stashed else self._staging
                self._write_masters(u, weights)
            self._point_off_device(u)
        for run_dir in stash_dirs.values():  # every file taken: the build's directory goes
            if not any(name.endswith(".w") for name in os.listdir(run_dir.path)):
                run_dir.remove()

    def _write_masters(self, u: Unit, weights: torch.Tensor) -> None:
        """``u``'s float32 masters, made from its weights' bytes ``weights`` (the weight's values exactly)."""
        assert self._mstaging is not None and u.mpath is not None
        for p in u.params:
            if p.moffset >= 0:
                view(self._mstaging, p.moffset, torch.float32, p.shape).copy_(view(weights, p.offset, p.dtype, p.shape))
        self._write(self._mstaging[:u.mbytes], u.mpath, f"unit {u.index}'s master weights")

    def _stashed(self, u: Unit) -> Optional[Stashed]:
        stashed = getattr(u.module, STASHED, None) if len(u.modules) == 1 else None
        if stashed is not None and (stashed.params != tuple(id(p.param) for p in u.params)
                                    or stashed.nbytes != u.nbytes):
            raise ModelStateError(f"{FLAG}: unit {u.index}'s parameters changed after its weights were written "
                                  f"to {stashed.path} as the model was built")
        return stashed

    def _write(self, data: torch.Tensor, path: str, what: str) -> None:
        _write_or_explain(data, path, what)

    def _point_off_device(self, u: Unit) -> None:
        """Parameters between uses: views of the host copy (``host``); for ``disk`` a one-element
        placeholder of the right shape (the values are in the file; :meth:`unit_weights` reads them).
        ``main_grad``: a view of the host accumulator where there is one, else None (in its file)."""
        for p in u.params:
            if u.host is not None:
                p.param.data = view(u.host, p.offset, p.dtype, p.shape)
            else:
                p.param.data = placeholder(p.param, torch.device("cpu"))
            if p.goffset >= 0:
                p.param.main_grad = None if u.ghost is None else view(u.ghost, p.goffset, p.grad_dtype, p.shape)

    def _read(self, path: str, nbytes: int, what: str) -> torch.Tensor:
        assert self._staging is not None
        return self._read_into(self._staging, path, nbytes, what)

    def _read_into(self, buf: torch.Tensor, path: str, nbytes: int, what: str) -> torch.Tensor:
        try:
            return read_file(path, nbytes, 0, buf[:nbytes])
        except DiskOffloadError as exc:
            raise ModelStateError(f"{FLAG} disk: reading {what} ({nbytes} bytes) failed: {exc}") from exc

    def _drain(self) -> None:
        """Wait (on the host) for every gradient copy to the host accumulators."""
        while self._copies_out:
            self._copies_out.pop().synchronize()

    def zero_grad(self) -> None:
        self._drain()
        for u in self.units:
            if u.ghost is not None:
                u.ghost.zero_()
            u.has_grad = u.reduced = False
            for p in u.params:  # as Megatron's DDP zero_grad_buffer
                if hasattr(p.param, "grad_added_to_main_grad"):
                    p.param.grad_added_to_main_grad = False

    def scale_grads(self, factor: float) -> None:
        """Multiply every accumulated main gradient by ``factor`` (Megatron's ``scale_gradients``)."""
        self._drain()
        for u in self.units:
            if u.ghost is not None:
                data = u.ghost
            elif u.has_grad:
                data = self._read(u.gpath, u.gbytes, f"unit {u.index}'s gradients")
            else:
                continue
            for p in u.params:
                if p.goffset >= 0:
                    view(data, p.goffset, p.grad_dtype, p.shape).mul_(factor)
            if u.ghost is None:
                self._write(data, u.gpath, f"unit {u.index}'s gradients")

    def unit_weights(self, index: int) -> list[torch.Tensor]:
        """Unit ``index``'s weights as they are off the device (copies for ``disk``)."""
        u = self.units[index]
        data = u.host if u.host is not None else self._read(u.path, u.nbytes, f"unit {index}'s weights").clone()
        return [view(data, p.offset, p.dtype, p.shape) for p in u.params]

    def unit_grads(self, index: int) -> list[Optional[torch.Tensor]]:
        """Unit ``index``'s accumulated main gradients (None where a parameter has none)."""
        self._drain()
        u = self.units[index]
        if u.ghost is not None:
            data: Optional[torch.Tensor] = u.ghost
        elif u.has_grad:
            data = self._read(u.gpath, u.gbytes, f"unit {index}'s gradients").clone()
        else:
            data = torch.zeros(u.gbytes, dtype=torch.uint8)
        return [None if p.goffset < 0 else view(data, p.goffset, p.grad_dtype, p.shape) for p in u.params]

    def _weights_change(self) -> None:
        """Called before a unit's weights are rewritten off the device (the streamer first waits for a read of
        them it started ahead)."""

    def store_weights(self, index: int, values: Sequence[torch.Tensor]) -> None:
        """Write updated weights of unit ``index`` to its off-device copy (``disk``; ``host`` is updated in
        place by an optimizer that steps the parameters)."""
        self._weights_change()
        u = self.units[index]
        if u.host is not None:
            for p, v in zip(u.params, values):
                view(u.host, p.offset, p.dtype, p.shape).copy_(v)
            return
        assert self._staging is not None and u.path is not None
        for p, v in zip(u.params, values):
            view(self._staging, p.offset, p.dtype, p.shape).copy_(v)
        self._write(self._staging[:u.nbytes], u.path, f"unit {index}'s weights")

    def unit_masters(self, index: int) -> list[Optional[torch.Tensor]]:
        """Unit ``index``'s float32 master weights (copies; None where the weight is float32 itself)."""
        u = self.units[index]
        if u.mpath is None:
            return [None] * len(u.params)
        data = self._read_into(torch.empty(u.mbytes, dtype=torch.uint8), u.mpath, u.mbytes,
                               f"unit {index}'s master weights")
        return [None if p.moffset < 0 else view(data, p.moffset, torch.float32, p.shape) for p in u.params]

    def store_masters(self, index: int, values: Sequence[Optional[torch.Tensor]]) -> None:
        """Write unit ``index``'s float32 master weights (a checkpoint's; None entries skipped)."""
        u = self.units[index]
        if u.mpath is None:
            return
        assert self._mstaging is not None
        data = self._read_into(self._mstaging, u.mpath, u.mbytes, f"unit {index}'s master weights")
        for p, v in zip(u.params, values):
            if p.moffset >= 0 and v is not None:
                view(data, p.moffset, torch.float32, p.shape).copy_(v)
        self._write(data, u.mpath, f"unit {index}'s master weights")

    @contextlib.contextmanager
    def masters_in(self, index: int) -> Iterator[list[tuple[torch.Tensor, Optional[torch.Tensor]]]]:
        """For a mixed-precision optimizer step: unit ``index``'s weights and float32 masters on the host, as
        ``(weight, master or None)`` per parameter (read into the staging buffers).  At the block's end the
        masters are written back, and the weights, rounded from them (float32 weights as the block left
        them), as Megatron's copy of the main parameters to the model's does.  The weights file is read only
        where a parameter has no master: the others' weights are rewritten from their masters, never read."""
        self._weights_change()
        u = self.units[index]
        assert u.path is not None and u.mpath is not None and self._mstaging is not None
        assert self._staging is not None
        if all(p.moffset >= 0 for p in u.params):
            weights = self._staging[:u.nbytes]
        else:
            weights = self._read(u.path, u.nbytes, f"unit {index}'s weights")
        masters = self._read_into(self._mstaging, u.mpath, u.mbytes, f"unit {index}'s master weights")
        pairs = [(view(weights, p.offset, p.dtype, p.shape),
                  view(masters, p.moffset, torch.float32, p.shape) if p.moffset >= 0 else None) for p in u.params]
        yield pairs
        for w, m in pairs:
            if m is not None:
                w.copy_(m)
        self._write(masters, u.mpath, f"unit {index}'s master weights")
        self._write(weights, u.path, f"unit {index}'s weights")

    def gather_weights(self, shards: Any) -> None:
        """After a step of the distributed optimizer (:mod:`.model_state_shards`), which updated this rank's
        range of each unit's weights: every unit's off-device weights whole again, from every rank's range
        (``disk``: each file read, gathered and written back, one unit on the host at a time)."""
        self._weights_change()
        for u in self.units:
            data = u.host if u.host is not None else self._read(u.path, u.nbytes, f"unit {u.index}'s weights")
            for dtype in dict.fromkeys(p.dtype for p in u.params):  # one collective per dtype in the unit
                shards.gather(u.index, [view(data, p.offset, p.dtype, p.shape) if p.dtype == dtype else None
                                        for p in u.params])
            if u.host is None:
                self._write(data, u.path, f"unit {u.index}'s weights")

    def gather_masters(self, shards: Any) -> None:
        """Every unit's float32 masters in their files whole again from every rank's range (the distributed
        optimizer updates only its own; a checkpoint saves them all)."""
        for u in self.units:
            if u.mpath is None:
                continue
            assert self._mstaging is not None
            data = self._read_into(self._mstaging, u.mpath, u.mbytes, f"unit {u.index}'s master weights")
            shards.gather(u.index, [view(data, p.moffset, torch.float32, p.shape) if p.moffset >= 0 else None
                                    for p in u.params])
            self._write(data, u.mpath, f"unit {u.index}'s master weights")

    def param_groups(self) -> list[list[torch.nn.Parameter]]:
        """The streamed parameters, one list per unit (what :meth:`grads_in` and :meth:`weights_in` bring in)."""
        return [[p.param for p in u.params] for u in self.units]

    @contextlib.contextmanager
    def grads_in(self, index: int) -> Iterator[list[torch.nn.Parameter]]:
        """Inside the block, unit ``index``'s accumulated gradients are its parameters' ``main_grad``, and their
        ``grad`` where the dtypes agree (zeros where nothing accumulated this step); ``disk`` reads them into the staging
        buffer, so one unit's gradients are on the host at a time."""
        self._drain()
        u = self.units[index]
        if u.ghost is not None:
            data = u.ghost
        else:
            assert self._staging is not None
            data = self._staging[:u.gbytes]
            if u.has_grad:
                data = self._read(u.gpath, u.gbytes, f"unit {index}'s gradients")
            else:
                data.zero_()
        with_grad = [p for p in u.params if p.goffset >= 0]
        for p in with_grad:
            g = view(data, p.goffset, p.grad_dtype, p.shape)
            p.param.main_grad = g
            if g.dtype == p.param.dtype:  # a bf16 weight's float32 gradient is its master's (main_grad only)
                p.param.grad = g
        try:
            yield [p.param for p in with_grad]
        finally:
            for p in with_grad:
                p.param.grad = None
            self._point_off_device(u)

    @contextlib.contextmanager
    def weights_in(self, index: int) -> Iterator[list[torch.nn.Parameter]]:
        """Inside the block, unit ``index``'s parameters hold its weights on the host (``disk``: read into the
        staging buffer); what the block writes into them is stored back at its end."""
        self._weights_change()
        u = self.units[index]
        if u.host is not None:  # the parameters are views of the host copy already
            yield [p.param for p in u.params]
            return
        data = self._read(u.path, u.nbytes, f"unit {index}'s weights")
        for p in u.params:
            p.param.data = view(data, p.offset, p.dtype, p.shape)
        try:
            yield [p.param for p in u.params]
            self._write(data, u.path, f"unit {index}'s weights")
        finally:
            self._point_off_device(u)

