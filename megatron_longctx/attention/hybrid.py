"""Hybrid attention: Ulysses inside groups of consecutive ranks, ring across the groups.

USP (Fang & Zhao 2024, "USP: A Unified Sequence Parallelism Approach", arXiv:2405.07719) and
LoongTrain's 2D attention (Gu et al. 2024, arXiv:2406.18485); Megatron/TE
``cp_comm_type="a2a+p2p"`` with ``hierarchical_context_parallel_sizes = [U, P/U]``.  Rank
``r = g*U + u`` first trades heads for sequence inside its all-to-all group ``g`` (ranks
``gU..gU+U-1``).  Afterwards it holds, for ``h/U`` heads, chunks ``gU..gU+U-1`` and their mirrors:
exactly zigzag shard ``g`` of ``P/U`` ranks with chunks ``U`` times longer, so the ring of
:mod:`.ring` runs unchanged across the groups.  The computation is therefore
:func:`.ulysses.ulysses_forward` / :func:`.ulysses.ulysses_backward` given a ring group; this
module lays out the two groups.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

_GROUPS: dict[tuple[dist.ProcessGroup, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def _registered(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def hybrid_ranks(cp_ranks: Sequence[int], cp_rank: int, ulysses_size: int) -> tuple[list[int], list[int]]:
    """Global ranks of this rank's (all-to-all group, ring group): ``ulysses_size`` consecutive cp ranks,
    and one rank of each such group (Megatron's ``create_hierarchical_groups`` order)."""
    a2a = list(cp_ranks[cp_rank - cp_rank % ulysses_size:][:ulysses_size])
    ring = list(cp_ranks[cp_rank % ulysses_size::ulysses_size])
    return a2a, ring


def hybrid_groups(cp_group: dist.ProcessGroup, ulysses_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(a2a_group, ring_group)`` of this rank for ``cp_group`` split as ``[ulysses_size, P/ulysses_size]``.

    Groups as :func:`hybrid_ranks` lays them out, created on first use
    with group-local synchronisation (only the members of a new group take part) and cached; every
    rank of ``cp_group`` must make this first call together.  Prefer passing Megatron's
    ``hcp`` groups (``cp_attention(..., hcp_groups=...)``), which exist already.
    """
    key = (cp_group, ulysses_size)
    if key not in _GROUPS or not all(map(_registered, _GROUPS[key])):  # none yet, or destroyed since
        ranks = dist.get_process_group_ranks(cp_group)
        a2a_ranks, ring_ranks = hybrid_ranks(ranks, dist.get_rank(cp_group), ulysses_size)
        a2a = dist.new_group(a2a_ranks, use_local_synchronization=True)
        ring = dist.new_group(ring_ranks, use_local_synchronization=True)
        _GROUPS[key] = (a2a, ring)
    return _GROUPS[key]
