"""Megatron's distributed optimizer over streamed model states (``--use-distributed-optimizer`` with
``--longctx-model-state-offload``): the optimizer's states sharded over the data-parallel x context-parallel
group (ZeRO stage 1, Rajbhandari et al., arXiv:1910.02054), the weights whole on every rank.

Each unit's parameters, laid end to end in the unit's order, are cut into one contiguous range of equal
length per rank (:class:`Shards`).  A unit's gradients are reduce-scattered as its backward ends
(:meth:`Shards.reduce_scatter`): each rank receives the sum of its range only, as Megatron's distributed
optimizer does.  A rank's off-device AdamW keeps Adam's moments for its range only and updates only those
elements of the weights (or their float32 masters); after the step each unit's updated ranges are
all-gathered into every rank's off-device copy (:meth:`Shards.gather`), so the next forward finds
the same weights on every rank.  The partition is in elements, not bytes, so the bf16 weights and their
float32 masters of one unit are cut at the same places.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
import torch.distributed as dist


class Shards:
    """Which elements of each unit's parameters this rank's optimizer owns, and the all-gather that makes
    every rank's copy whole again.

    ``numels[u]``: the element counts of unit ``u``'s parameters in the unit's order.  ``group``: the
    data-parallel x context-parallel group (the one the gradients are summed over).  ``buffers``: lends two
    byte buffers on the compute device (NCCL reads device memory; host values are copied through them), the
    receive and the send buffer of the all-gathers: the streamer's idle weight slots
    (:meth:`~megatron_longctx.memory.model_states.ModelStateStreamer.idle_slots`), so the gathers allocate
    nothing on the device.
    """

    def __init__(self, numels: Sequence[Sequence[int]], group: Any,
                 buffers: Callable[[], ContextManager[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        self.group, self._buffers = group, buffers
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.starts: list[list[int]] = []  # each parameter's first element in its unit's concatenation
        self.numels = [list(n) for n in numels]
        self.part: list[int] = []  # elements per rank, per unit
        for unit in self.numels:
            at, starts = 0, []
            for n in unit:
                starts.append(at)
                at += n
            self.starts.append(starts)
            self.part.append(-(-at // self.world))
        self.gathered_elements = 0  # elements received by all-gathers (the cost a test counts)
        self.largest_gather_bytes = 0  # the most one all-gather received (bounded by the lent buffer)
        self.scattered_elements = 0  # elements the reduce-scatters of gradients read

    def owned(self, unit: int, k: int) -> tuple[int, int]:
        """This rank's element range ``[lo, hi)`` of parameter ``k`` of ``unit`` (``lo == hi``: none)."""
        first, part = self.starts[unit][k], self.part[unit]
        lo = min(max(self.rank * part - first, 0), self.numels[unit][k])
        hi = max(min((self.rank + 1) * part - first, self.numels[unit][k]), lo)
        return lo, hi

    def owned_numel(self, unit: int) -> int:
        return sum(hi - lo for lo, hi in (self.owned(unit, k) for k in range(len(self.numels[unit]))))

    def _flat(self, unit: int, values: Sequence[Optional[torch.Tensor]]) -> Optional[tuple]:
        """``(dtype, bytes per element, flat views)`` of one unit's values (None where a parameter has none);
        None when no parameter has one."""
        present = [v for v in values if v is not None]
        if not present:
            return None
        dtype = present[0].dtype
        if any(v.dtype != dtype for v in present):
            raise TypeError(f"unit {unit}: one dtype per collective, got {sorted({str(v.dtype) for v in present})}")
        if not all(v.is_contiguous() for v in present):
            raise ValueError(f"unit {unit}: the collectives write into its tensors in place; they must be contiguous")
        return dtype, present[0].element_size(), [None if v is None else v.reshape(-1) for v in values]

    def _chunk(self, unit: int, pieces: int, nbytes: int, size: int) -> int:
        """Elements per rank of one collective whose buffer, ``pieces`` chunks of them, fits in ``nbytes``."""
        step = min(nbytes // (size * pieces), self.part[unit])
        if step < 1:
            raise ValueError(f"unit {unit}: buffers of {nbytes} bytes cannot hold one element per rank "
                             f"({self.world} ranks, {size} bytes)")
        return step

    @torch.no_grad()
    def gather(self, unit: int, values: Sequence[Optional[torch.Tensor]]) -> None:
        """``values[k]``: parameter ``k``'s values (this rank's range current; None: a parameter with no such
        tensor, e.g. no float32 master), all of one dtype.  Afterwards every element holds its owner's value.

        The ranges travel in chunks through the two lent buffers: a chunk of ``c`` elements per rank is sent
        from one and received (``c`` x ranks) into the other, so a unit larger than the buffers (an
        embedding's float32 masters) needs several collectives and nothing more on the device."""
        flat = self._flat(unit, values)
        if flat is None:
            return
        dtype, size, flat = flat
        part = self.part[unit]
        with self._buffers() as (recv, send):
            step = min(self._chunk(unit, self.world, recv.numel(), size), send.numel() // size)
            for c0 in range(0, part, step):
                c = min(step, part - c0)
                chunk, out = send[:c * size].view(dtype), recv[:c * size * self.world].view(dtype)
                for dst, src in self._pieces(unit, flat, self.rank * part + c0, c):
                    chunk[dst].copy_(src)
                dist.all_gather_into_tensor(out, chunk, group=self.group)
                for r in range(self.world):
                    for src, dst in self._pieces(unit, flat, r * part + c0, c):
                        dst.copy_(out[r * c:(r + 1) * c][src])
                self.gathered_elements += out.numel()
                self.largest_gather_bytes = max(self.largest_gather_bytes, out.numel() * size)

    @torch.no_grad()
    def reduce_scatter(self, unit: int, values: Sequence[Optional[torch.Tensor]], scratch: torch.Tensor) -> None:
        """``values[k]``: parameter ``k``'s gradient on this rank (None: it has none), one dtype, on the
        device.  Afterwards this rank's range holds their sum over the group and every other element is zero,
        so a norm over each rank's gradients, summed over the group, is the norm of the summed gradients
        (Megatron's distributed optimizer reduces its statistics so).  ``scratch``: a byte buffer on the device
        (the unit's weight slot, idle once its backward is done): chunks of ``c`` elements per rank are laid
        out there rank by rank (``c`` x ranks), and the sum of this rank's lands beside them."""
        flat = self._flat(unit, values)
        if flat is None:
            return
        dtype, size, flat = flat
        part = self.part[unit]
        step = self._chunk(unit, self.world + 1, scratch.numel(), size)
        for c0 in range(0, part, step):
            c = min(step, part - c0)
            rows = scratch[:c * size * self.world].view(dtype)
            mine = scratch[c * size * self.world:c * size * (self.world + 1)].view(dtype)
            rows.zero_()  # what no parameter covers (the last rank's padding) adds nothing
            for r in range(self.world):
                for dst, src in self._pieces(unit, flat, r * part + c0, c):
                    rows[r * c:(r + 1) * c][dst].copy_(src)
            dist.reduce_scatter_tensor(mine, rows, group=self.group)
            for src, dst in self._pieces(unit, flat, self.rank * part + c0, c):
                dst.copy_(mine[src])
            self.scattered_elements += rows.numel()
        self.keep_owned(unit, values)

    @torch.no_grad()
    def keep_owned(self, unit: int, values: Sequence[Optional[torch.Tensor]]) -> None:
        """Every element of ``values`` outside this rank's range set to zero."""
        for k, v in enumerate(values):
            if v is not None:
                lo, hi = self.owned(unit, k)
                v.reshape(-1)[:lo].zero_()
                v.reshape(-1)[hi:].zero_()

    def _pieces(self, unit: int, flat: Sequence[Optional[torch.Tensor]], at: int, c: int) -> Iterator[tuple]:
        """For the unit's elements ``[at, at + c)`` of its concatenation: ``(slice of the chunk, the
        parameter's view there)``, one per parameter with values that overlaps them."""
        for k, v in enumerate(flat):
            first = self.starts[unit][k]
            lo, hi = max(at, first), min(at + c, first + self.numels[unit][k])
            if v is not None and hi > lo:
                yield slice(lo - at, hi - at), v[lo - first:hi - first]

    def whole_moments(self, optimizers: Sequence[Any], targets: Sequence[Sequence[torch.Tensor]]) -> list[dict]:
        """Every rank's Adam moments, whole per parameter, for a checkpoint (a collective: every rank calls it).

        ``optimizers``: the sharded off-device AdamWs (``kept_moments``); ``targets[u][k]``: the tensor an
        optimizer steps for parameter ``k`` of unit ``u`` (its float32 master, or the parameter itself).
        Returns, per optimizer, ``id(target) -> (exp_avg, exp_avg_sq)``, for its ``set_gathered``."""
        owner = {id(p): i for i, opt in enumerate(optimizers) for g in opt.param_groups for p in g["params"]}
        whole: list[dict] = [{} for _ in optimizers]
        for unit, ts in enumerate(targets):
            moments: list = [None] * len(ts)
            for k, t in enumerate(ts):
                if id(t) in owner:
                    lo, hi = self.owned(unit, k)
                    m, v = torch.zeros(t.numel()), torch.zeros(t.numel())
                    m[lo:hi], v[lo:hi] = optimizers[owner[id(t)]].kept_moments(t)
                    moments[k] = (m, v)
            for i in (0, 1):
                self.gather(unit, [None if mv is None else mv[i] for mv in moments])
            for t, mv in zip(ts, moments):
                if mv is not None:
                    whole[owner[id(t)]][id(t)] = mv
        return whole
