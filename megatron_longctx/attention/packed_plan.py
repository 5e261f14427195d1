"""Kernel calls of document-aware attention over packed shards: one plan per document, then shifted.

Queries see keys of their own document only, at document-relative positions (what Megatron's THD
RoPE gives them).  For each document the (query segments, key segments) of two shards are planned
with :func:`.segments.plan_blocks` (causal / windowed, blocks without a visible pair skipped), and
the calls are moved to where the document sits in each local tensor.  Pairs of different documents
are never planned, and padding tokens are in no segment: they see nothing and nobody sees them.

Pure functions of the layout and the mask, cached; every rank can compute every rank's plan.
"""

from __future__ import annotations

import dataclasses
import functools

from ..kernels.base import BlockMask
from .packed_layout import PackedLayout
from .ring import RingSchedule
from .segments import BlockCall, plan_blocks


def _shift(call: BlockCall, q_base: int, k_base: int) -> BlockCall:
    return dataclasses.replace(
        call, q_lo=call.q_lo + q_base, q_hi=call.q_hi + q_base, k_lo=call.k_lo + k_base, k_hi=call.k_hi + k_base
    )


@functools.lru_cache(maxsize=1024)
def packed_calls(
    q_layout: PackedLayout, q_rank: int, k_layout: PackedLayout, k_rank: int, mask: BlockMask
) -> tuple[BlockCall, ...]:
    """Calls of shard ``q_rank`` of ``q_layout`` (queries) against shard ``k_rank`` of ``k_layout`` (keys).

    Both layouts describe the same packing (``k_layout`` may be coarser, e.g. the whole sequence
    for all-gather).  Row/column indices are local to the two shards.
    """
    calls = []
    for d in range(q_layout.packing.num_docs):
        q_segs, k_segs = q_layout.segments(d, q_rank), k_layout.segments(d, k_rank)
        if not q_segs or not k_segs:
            continue
        q_base, k_base = q_layout.local_starts[d], k_layout.local_starts[d]
        calls.extend(_shift(c, q_base, k_base) for c in plan_blocks(q_segs, k_segs, mask))
    return tuple(calls)


@functools.lru_cache(maxsize=256)
def packed_ring_schedule(layout: PackedLayout, mask: BlockMask) -> RingSchedule:
    """The ring over ``layout``: every rank's calls at every offset where some rank has a visible block.

    Same shape as :func:`.ring.ring_schedule` (``offsets[i]``: at step ``i`` rank ``r`` holds the
    K/V of rank ``r - offsets[i]``), so the ring loop and FLOP accounting are shared.
    """
    p = layout.cp_size
    offsets, calls = [], []
    for t in range(p):
        step = tuple(packed_calls(layout, r, layout, (r - t) % p, mask) for r in range(p))
        if t == 0 or any(step):
            offsets.append(t)
            calls.append(step)
    return RingSchedule(layout, tuple(offsets), tuple(calls))


def packed_allgather_calls(layout: PackedLayout, rank: int, mask: BlockMask) -> tuple[BlockCall, ...]:
    """Calls of ``rank``'s queries against the gathered K/V in natural padded order."""
    return packed_calls(layout, rank, layout.coarsen(layout.cp_size), 0, mask)


def packed_pairs(algorithm: str, layout: PackedLayout, mask: BlockMask, ulysses_size: int = 1) -> list[float]:
    """Visible (query, key) pairs each rank computes per head (query heads are split by Ulysses).

    ``ring`` and ``allgather``: the rank's own queries.  ``ulysses``: every query of ``1/cp`` of the
    heads (reported per head of the full model, i.e. total pairs divided by cp).  ``hybrid``: the
    ring of the coarse layout, divided over the ``ulysses_size`` ranks of each group.
    """
    p = layout.cp_size
    if algorithm == "ring":
        schedule = packed_ring_schedule(layout, mask)
        return [schedule.pairs(r) for r in range(p)]
    if algorithm == "allgather":
        return [sum(c.pairs for c in packed_allgather_calls(layout, r, mask)) for r in range(p)]
    u = p if algorithm == "ulysses" else ulysses_size
    if algorithm not in ("ulysses", "hybrid"):
        raise ValueError(f"algorithm={algorithm!r} is not one of ('ring', 'allgather', 'ulysses', 'hybrid')")
    schedule = packed_ring_schedule(layout.coarsen(u), mask)
    return [schedule.pairs(r // u) / u for r in range(p)]
