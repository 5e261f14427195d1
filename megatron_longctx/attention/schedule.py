"""Block schedules: which kernel calls each rank runs, for every algorithm, from one layout.

Queries see keys of their own document only, at document-relative positions (what Megatron's RoPE
gives them; a dense sequence is one document).  For each document the (query segments, key
segments) of two shards are turned into calls by :func:`.segments.schedule_blocks` (causal / windowed,
blocks without a visible pair skipped, neighbours coalesced, so one zigzag ring step is one kernel
call), and the calls are moved to where the document sits in each local tensor.  Pairs of different
documents are never scheduled, and padding tokens are in no segment.

* :func:`ring_schedule`: the steps of the ring (Ring Attention, Liu et al. 2023) over a layout; a
  layout of one rank is plain local attention, and the ring of a coarsened layout is what Ulysses
  (one rank) and the hybrid (``cp/U`` ranks) run after their all-to-all.
* :func:`allgather_calls`: one rank's queries against the gathered sequence (Llama 3).
* :func:`schedule_pairs`: the visible (query, key) pairs each rank computes, for FLOP accounting.

Pure functions of the layout and the mask, cached; every rank can compute every rank's schedule.
"""

from __future__ import annotations

import dataclasses
import functools

from ..kernels.base import BlockMask
from .. import cp_algorithms as algorithms
from .layout import SeqLayout
from .segments import BlockCall, schedule_blocks


def _shift(call: BlockCall, q_base: int, k_base: int) -> BlockCall:
    if q_base == 0 and k_base == 0:
        return call
    return dataclasses.replace(
        call, q_lo=call.q_lo + q_base, q_hi=call.q_hi + q_base, k_lo=call.k_lo + k_base, k_hi=call.k_hi + k_base
    )


@functools.lru_cache(maxsize=1024)
def layout_calls(
    q_layout: SeqLayout, q_rank: int, k_layout: SeqLayout, k_rank: int, mask: BlockMask
) -> tuple[BlockCall, ...]:
    """Calls of shard ``q_rank`` of ``q_layout`` (queries) against shard ``k_rank`` of ``k_layout`` (keys).

    Both layouts describe the same packing (``k_layout`` may be coarser, e.g. the whole sequence
    for all-gather).  Row/column indices are local to the two shards.
    """
    calls = []
    for d in range(q_layout.num_docs):
        q_segs, k_segs = q_layout.segments(d, q_rank), k_layout.segments(d, k_rank)
        if not q_segs or not k_segs:
            continue
        q_base, k_base = q_layout.local_starts[d], k_layout.local_starts[d]
        calls.extend(_shift(c, q_base, k_base) for c in schedule_blocks(q_segs, k_segs, mask))
    return tuple(calls)


@dataclasses.dataclass(frozen=True)
class RingSchedule:
    """The steps a ring runs.

    ``offsets[i]``: at step ``i`` every rank ``r`` holds the K/V of rank ``r - offsets[i]``
    (``offsets[0] == 0``, increasing).  ``calls[i][r]``: rank ``r``'s kernel calls at step ``i``.
    """

    layout: SeqLayout  # what the schedule was computed from
    offsets: tuple[int, ...]
    calls: tuple[tuple[tuple[BlockCall, ...], ...], ...]

    @property
    def transfers(self) -> int:
        """K/V messages each rank sends in forward."""
        return len(self.offsets) - 1

    def hop(self, i: int) -> int:
        """Distance the K/V move after step ``i`` (to ``rank + hop``)."""
        return self.offsets[i + 1] - self.offsets[i]

    def pairs(self, rank: int) -> int:
        """Visible (query, key) pairs rank ``rank`` computes over the whole ring (per batch and head)."""
        return sum(c.pairs for step in self.calls for c in step[rank])


@functools.lru_cache(maxsize=256)
def ring_schedule(layout: SeqLayout, mask: BlockMask) -> RingSchedule:
    """Every rank's calls at every offset where some rank has a visible block (all ranks agree).

    An offset no rank has a visible block at is skipped altogether, and the transfer jumps over it
    (a small sliding window on the zigzag layout needs offsets ``{0, 1, P-1}`` only).
    """
    p = layout.cp_size
    offsets, calls = [], []
    for t in range(p):
        step = tuple(layout_calls(layout, r, layout, (r - t) % p, mask) for r in range(p))
        if t == 0 or any(step):
            offsets.append(t)
            calls.append(step)
    return RingSchedule(layout, tuple(offsets), tuple(calls))


def allgather_calls(layout: SeqLayout, rank: int, mask: BlockMask) -> tuple[BlockCall, ...]:
    """Calls of ``rank``'s queries against the gathered K/V in natural order."""
    return layout_calls(layout, rank, layout.coarsen(layout.cp_size), 0, mask)


def allgather_calls_by_rank(layout: SeqLayout, rank: int, mask: BlockMask) -> tuple[BlockCall, ...]:
    """Calls of ``rank``'s queries against the gathered K/V in rank order: rank ``j``'s shard at key rows
    ``[j*t, (j+1)*t)`` (what an all-gather leaves, with no reordering copy)."""
    t = layout.local_len
    return tuple(_shift(c, 0, j * t) for j in range(layout.cp_size) for c in layout_calls(layout, rank, layout, j, mask))


def schedule_pairs(algorithm: str, layout: SeqLayout, mask: BlockMask, ulysses_size: int | None = None
                   ) -> tuple[list[int], int]:
    """``(pairs, heads_divisor)``: rank ``r`` computes ``pairs[r] / heads_divisor`` visible (query, key)
    pairs per query head of the model.

    ``ring`` and ``allgather``: the rank's own queries over all heads (divisor 1).  ``ulysses``: every
    query of ``1/cp`` of the heads.  ``hybrid``: the ring of the coarse layout over ``1/ulysses_size``
    of the heads.
    """
    p, algo = layout.cp_size, algorithms.get(algorithm)
    if algo.gathers_kv:
        return [sum(c.pairs for c in allgather_calls(layout, r, mask)) for r in range(p)], 1
    u = algo.ulysses_degree(p, ulysses_size)
    schedule = ring_schedule(layout.coarsen(u), mask)
    return [schedule.pairs(r // u) for r in range(p)], u


def packed_pairs(algorithm: str, layout: SeqLayout, mask: BlockMask, ulysses_size: int = 1) -> list[float]:
    """Visible (query, key) pairs each rank computes per query head (Ulysses/hybrid split the heads)."""
    pairs, divisor = schedule_pairs(algorithm, layout, mask, ulysses_size)
    return [n / divisor for n in pairs]

