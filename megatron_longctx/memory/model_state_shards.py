"""Megatron's distributed optimizer over streamed model states (``--use-distributed-optimizer`` with
``--longctx-model-state-offload``): the optimizer's states sharded over the data-parallel x context-parallel
group (ZeRO stage 1, Rajbhandari et al., arXiv:1910.02054), the weights and gradients whole on every rank.

Each unit's parameters, laid end to end in the unit's order, are cut into one contiguous range of equal
length per rank (:class:`Shards`).  A rank's off-device AdamW keeps Adam's moments for its range only and
updates only those elements of the weights (or their float32 masters); after the step each unit's updated
ranges are all-gathered into every rank's off-device copy (:meth:`Shards.gather`), so the next forward finds
the same weights on every rank.  The partition is in elements, not bytes, so the bf16 weights and their
float32 masters of one unit are cut at the same places.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist


class Shards:
    """Which elements of each unit's parameters this rank's optimizer owns, and the all-gather that makes
    every rank's copy whole again.

    ``numels[u]``: the element counts of unit ``u``'s parameters in the unit's order.  ``group``: the
    data-parallel x context-parallel group (the one the gradients are summed over).  ``device``: where the
    collective runs (the compute device: NCCL reads device memory; host values are copied through it).
    """

    def __init__(self, numels: Sequence[Sequence[int]], group: Any, device: torch.device) -> None:
        self.group, self.device = group, device
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

    def owned(self, unit: int, k: int) -> tuple[int, int]:
        """This rank's element range ``[lo, hi)`` of parameter ``k`` of ``unit`` (``lo == hi``: none)."""
        first, part = self.starts[unit][k], self.part[unit]
        lo = min(max(self.rank * part - first, 0), self.numels[unit][k])
        hi = max(min((self.rank + 1) * part - first, self.numels[unit][k]), lo)
        return lo, hi

    def owned_numel(self, unit: int) -> int:
        return sum(hi - lo for lo, hi in (self.owned(unit, k) for k in range(len(self.numels[unit]))))

    @torch.no_grad()
    def gather(self, unit: int, values: Sequence[Optional[torch.Tensor]]) -> None:
        """``values[k]``: parameter ``k``'s values (this rank's range current; None: a parameter with no such
        tensor, e.g. no float32 master), all of one dtype.  Afterwards every element holds its owner's value."""
        present = [v for v in values if v is not None]
        if not present:
            return
        dtype, part = present[0].dtype, self.part[unit]
        if any(v.dtype != dtype for v in present):
            raise TypeError(f"unit {unit}: one dtype per gather, got {sorted({str(v.dtype) for v in present})}")
        if not all(v.is_contiguous() for v in present):
            raise ValueError(f"unit {unit}: the gather writes into its tensors in place; they must be contiguous")
        send = torch.zeros(part, dtype=dtype, device=self.device)
        base = self.rank * part
        for k, v in enumerate(values):
            lo, hi = self.owned(unit, k)
            if v is not None and hi > lo:
                first = self.starts[unit][k] + lo - base
                send[first:first + hi - lo].copy_(v.reshape(-1)[lo:hi])
        out = torch.empty(part * self.world, dtype=dtype, device=self.device)
        dist.all_gather_into_tensor(out, send, group=self.group)
        for k, v in enumerate(values):
            if v is not None:
                first = self.starts[unit][k]
                v.reshape(-1).copy_(out[first:first + self.numels[unit][k]])  # v is contiguous: reshape views it
        self.gathered_elements += out.numel()

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
