"""The process groups of the hybrid (USP / Megatron ``a2a+p2p``): all-to-all inside, ring across.

USP (Fang & Zhao 2024, arXiv:2405.07719) and LoongTrain's 2D attention (Gu et al. 2024,
arXiv:2406.18485); Megatron/TE ``cp_comm_type="a2a+p2p"`` with ``hierarchical_context_parallel_sizes
= [U, P/U]``.  Rank ``r = g*U + u`` of ``cp_group`` belongs to all-to-all group ``g`` (ranks
``gU..gU+U-1``) and to ring group ``u`` (one rank of each all-to-all group).  The computation runs in
:mod:`.ulysses`; this module only lays out, creates or checks the two groups.
"""

from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from .. import cp_algorithms as algorithms

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


def check_hcp_groups(hcp_groups, cp_group, cp_size: int, ulysses_size, hq: int) -> tuple:
    """Megatron's ``(a2a_group, ring_group)`` must split ``cp_group`` as :func:`hybrid_ranks` does."""
    if len(hcp_groups) != 2:
        raise ValueError(f"hcp_groups must be (a2a_group, ring_group), inner all-to-all group first; "
                         f"got {len(hcp_groups)} groups")
    a2a, ring = hcp_groups
    u, r = dist.get_world_size(a2a), dist.get_world_size(ring)
    if ulysses_size not in (None, u):
        raise ValueError(f"ulysses_size={ulysses_size} disagrees with the a2a group in hcp_groups (size {u})")
    expected = hybrid_ranks(dist.get_process_group_ranks(cp_group), dist.get_rank(cp_group), u)
    got = (dist.get_process_group_ranks(a2a), dist.get_process_group_ranks(ring))
    cp_rank = dist.get_rank(cp_group)
    positions = (dist.get_rank(a2a), dist.get_rank(ring)) == (cp_rank % u, cp_rank // u)
    if u * r != cp_size or [sorted(g) for g in got] != [sorted(g) for g in expected] or not positions:
        raise ValueError(
            f"hcp_groups (global ranks {got[0]} x {got[1]}) must split cp_group (size {cp_size}) as Megatron's "
            f"hierarchical_context_parallel_sizes do, inner all-to-all group first: expected {expected[0]} "
            f"x {expected[1]}"
        )
    if hq % u != 0:
        raise ValueError(f"the a2a group of hcp_groups (size {u}) must divide the query heads ({hq})")
    return a2a, ring


def a2a_and_ring_groups(algorithm: str, cp_group, cp_size: int, ulysses_size, hcp_groups, hq: int):
    """(all-to-all group or None, ring group or None) of ``algorithm`` over ``cp_group`` (sizes checked).

    ``ring``: no all-to-all, the ring spans ``cp_group``; ``ulysses``: the all-to-all spans it and the
    ring is one rank; ``hybrid``: Megatron's ``hcp_groups`` or groups of ``ulysses_size``.  A group of
    one rank is returned as None.
    """
    if cp_size == 1:
        return None, None
    heads = algorithms.get(algorithm).heads
    if heads == "none":  # all-gather uses no sub-group: cp_group as for the ring
        return None, cp_group
    if heads == "all":
        return cp_group, None
    if hcp_groups is not None:
        a2a, ring = check_hcp_groups(hcp_groups, cp_group, cp_size, ulysses_size, hq)
    else:
        a2a, ring = hybrid_groups(cp_group, ulysses_size)
    u = dist.get_world_size(a2a)
    return (a2a if u > 1 else None), (ring if u < cp_size else None)
