"""The zigzag rule of Megatron's load-balanced context-parallel layout, written once.

A sequence (or each packed document) is cut into ``2*cp`` chunks and rank ``r`` keeps chunks ``r`` and
``2*cp-1-r``: the early chunk of cheap causal rows and its mirror of expensive ones, so every rank does
the same causal work (Megatron-Core's ``get_batch_on_this_cp_rank``; ring-flash-attention's zigzag).
"""

from __future__ import annotations


def zigzag_chunks(rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunk indices (of ``2*cp_size``) that ``rank`` holds, in local memory order."""
    return rank, 2 * cp_size - 1 - rank


def chunk_owners(cp_size: int) -> list[tuple[int, int]]:
    """For each natural chunk ``g`` of ``2*cp_size``: (rank holding it, which of its two halves)."""
    owners = [(0, 0)] * (2 * cp_size)
    for r in range(cp_size):
        first, second = zigzag_chunks(r, cp_size)
        owners[first], owners[second] = (r, 0), (r, 1)
    return owners
