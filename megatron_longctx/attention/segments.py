"""Token *segments* and the block calls between them: the geometry every context-parallel algorithm shares.

A rank's tokens are a few contiguous runs of global positions, its *segments*: under Megatron's
load-balanced layout rank ``r`` of ``P`` holds ``[(r*c, c), ((2P-1-r)*c, c)]`` (``c`` = chunk
length), concatenated in that order in memory.  :func:`schedule_blocks` turns one (query segments,
key segments) pair into a short list of kernel calls: every visible (query segment, key segment)
block is computed exactly once, blocks outside the mask are skipped, and neighbouring blocks are
coalesced into one call whenever a single mask over the rectangle they span reproduces the true
mask of each block (one step of the zigzag ring is one kernel call, as in ring-flash-attention's
zigzag variant).  The schedule is a pure function of positions, so every rank can compute every
other rank's.  :mod:`.block_loop` runs the calls.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import NamedTuple

from ..kernels.base import BlockMask, Visibility

DENSE = BlockMask(causal=False, window=(-1, -1))


class Segment(NamedTuple):
    """A contiguous run of ``length`` tokens starting at global position ``start``."""

    start: int
    length: int


Segments = tuple[Segment, ...]


@dataclasses.dataclass(frozen=True)
class BlockCall:
    """One kernel call: local query rows ``[q_lo, q_hi)`` against local key rows ``[k_lo, k_hi)``.

    ``mask``, ``q_start`` and ``k_start`` are what the kernel sees (the positions of the first row
    and column of the call).  They reproduce the true mask of every block inside the rectangle,
    though they need not be the true global positions.  ``pairs``: visible (query, key) pairs.
    """

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    mask: BlockMask
    q_start: int
    k_start: int
    pairs: int


def local_offsets(segs: Segments) -> list[int]:
    """Offset of each segment in the concatenated local tensor, plus the total length at the end."""
    return list(itertools.accumulate((s.length for s in segs), initial=0))


def visible_pairs(mask: BlockMask, q_start: int, q_len: int, k_start: int, k_len: int) -> int:
    """Number of visible (query, key) pairs of one block (exact; used for FLOP accounting).

    Integer arithmetic only (no tensors): the pairs with ``q - k <= t`` are
    ``sum_q clamp(k_start + k_len + t - q, 0, k_len)``, an arithmetic series cut at 0 and ``k_len``;
    the visible ones are those with ``-right <= q - k <= left``.
    """
    if q_len <= 0 or k_len <= 0:
        return 0

    def series(x: int) -> int:  # sum of min(y, k_len) over y = 1..x (0 for x <= 0)
        if x <= 0:
            return 0
        if x <= k_len:
            return x * (x + 1) // 2
        return k_len * (k_len + 1) // 2 + (x - k_len) * k_len

    def at_most(t: int) -> int:  # pairs with q - k <= t
        top = k_start + k_len + t - q_start  # the clamp's argument at the first query
        return series(top) - series(top - q_len)

    upper = at_most(mask.left) if mask.left >= 0 else q_len * k_len
    lower = at_most(-mask.right - 1) if mask.right >= 0 else 0
    return upper - lower


def _anchored_positions(segs: Segments, offsets: list[int], first: int, last: int) -> list[int]:
    """Positions the segments ``first..last`` take when laid out contiguously from ``segs[first].start``."""
    base = segs[first].start - offsets[first]
    return [base + offsets[i] for i in range(first, last + 1)]


def _rect_mask(mask: BlockMask, q_segs, k_segs, q_off, k_off, vis, rect) -> tuple[BlockMask, int, int] | None:
    """One (mask, q_start, k_start) reproducing the true mask of every block of ``rect``, or None."""
    i0, i1, j0, j1 = rect
    blocks = [(i, j) for i in range(i0, i1 + 1) for j in range(j0, j1 + 1)]
    if all(vis[i][j] is Visibility.FULL for i, j in blocks):
        return DENSE, 0, 0
    q_pos = _anchored_positions(q_segs, q_off, i0, i1)
    k_pos = _anchored_positions(k_segs, k_off, j0, j1)
    for i, j in blocks:
        pq, pk = q_pos[i - i0], k_pos[j - j0]
        local = mask.visibility(pq, q_segs[i].length, pk, k_segs[j].length)
        if local is not vis[i][j]:
            return None
        if local is Visibility.PARTIAL and pq - pk != q_segs[i].start - k_segs[j].start:
            return None
    return mask, q_pos[0], k_pos[0]


def _trim(mask: BlockMask, q_lo, q_hi, q_start, k_lo, k_hi, k_start) -> BlockCall | None:
    """The call cut to its live block (:meth:`BlockMask.live_block`): keys no query sees and queries that see
    no key dropped; None when nothing is visible."""
    live = mask.live_block(q_start, q_hi - q_lo, k_start, k_hi - k_lo)
    if live is None:
        return None
    q_first, k_first = q_start + live.q_lo, k_start + live.k_lo
    pairs = visible_pairs(mask, q_first, live.q_hi - live.q_lo, k_first, live.k_hi - live.k_lo)
    return BlockCall(q_lo + live.q_lo, q_lo + live.q_hi, k_lo + live.k_lo, k_lo + live.k_hi, mask, q_first, k_first,
                     pairs)


def restrict_rows(calls: tuple[BlockCall, ...], lo: int, hi: int) -> tuple[BlockCall, ...]:
    """``calls`` cut to query rows ``[lo, hi)``, with rows renumbered from ``lo`` (a query tile).

    Each call's mask and positions hold row by row, so cutting rows keeps them exact; keys no row of
    the cut sees are trimmed away again.
    """
    out = []
    for c in calls:
        q_lo, q_hi = max(c.q_lo, lo), min(c.q_hi, hi)
        if q_lo >= q_hi:
            continue
        cut = _trim(c.mask, q_lo - lo, q_hi - lo, c.q_start + (q_lo - c.q_lo), c.k_lo, c.k_hi, c.k_start)
        if cut is not None:
            out.append(cut)
    return tuple(out)


def split_keys(calls: tuple[BlockCall, ...], block: int) -> tuple[BlockCall, ...]:
    """``calls`` with every key range cut into runs of at most ``block`` keys (rows that see none dropped).

    Each piece's backward then returns dK/dV for at most ``block`` keys.
    """
    out = []
    for c in calls:
        for k_lo in range(c.k_lo, c.k_hi, block):
            k_hi = min(k_lo + block, c.k_hi)
            cut = _trim(c.mask, c.q_lo, c.q_hi, c.q_start, k_lo, k_hi, c.k_start + (k_lo - c.k_lo))
            if cut is not None:
                out.append(cut)
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def schedule_blocks(q_segs: Segments, k_segs: Segments, mask: BlockMask) -> tuple[BlockCall, ...]:
    """Kernel calls that compute attention of ``q_segs`` over ``k_segs`` under ``mask``.

    Greedy cover of the visible blocks by rectangles (contiguous runs of query segments x
    contiguous runs of key segments), largest first; a rectangle qualifies when one mask over it
    (dense, or ``mask`` anchored at its first block) reproduces every block's true visibility and,
    for partially visible blocks, the exact query-key offset.  Each visible block lands in one call.
    """
    q_off, k_off = local_offsets(q_segs), local_offsets(k_segs)
    vis = [[mask.visibility(qs.start, qs.length, ks.start, ks.length) for ks in k_segs] for qs in q_segs]
    todo = {(i, j) for i in range(len(q_segs)) for j in range(len(k_segs)) if vis[i][j] is not Visibility.NONE}
    rects = [
        (i0, i1, j0, j1)
        for i0 in range(len(q_segs)) for i1 in range(i0, len(q_segs))
        for j0 in range(len(k_segs)) for j1 in range(j0, len(k_segs))
    ]
    calls: list[BlockCall] = []
    while todo:
        best, best_key = None, None
        for rect in rects:
            i0, i1, j0, j1 = rect
            inside = {(i, j) for i in range(i0, i1 + 1) for j in range(j0, j1 + 1)}
            visible = {b for b in inside if vis[b[0]][b[1]] is not Visibility.NONE}
            if not visible or not visible <= todo:
                continue
            found = _rect_mask(mask, q_segs, k_segs, q_off, k_off, vis, rect)
            if found is None:
                continue
            wasted = sum(q_segs[i].length * k_segs[j].length for i, j in inside - visible)
            key = (len(visible), -wasted, found[0] is DENSE)
            if best_key is None or key > best_key:
                best, best_key = (rect, found, visible), key
        (i0, i1, j0, j1), (rect_mask, q_start, k_start), visible = best
        call = _trim(rect_mask, q_off[i0], q_off[i1 + 1], q_start, k_off[j0], k_off[j1 + 1], k_start)
        if call is not None:
            calls.append(call)
        todo -= visible
    return tuple(calls)


def split_rows(call: BlockCall, row: int) -> tuple[BlockCall, ...]:
    """``call`` cut before local query row ``row``: its rows above and from ``row`` on, each trimmed to the
    keys they see (a part that sees nothing is dropped)."""
    if not call.q_lo < row < call.q_hi:
        return (call,)
    shift = row - call.q_lo
    parts = (_trim(call.mask, call.q_lo, row, call.q_start, call.k_lo, call.k_hi, call.k_start),
             _trim(call.mask, row, call.q_hi, call.q_start + shift, call.k_lo, call.k_hi, call.k_start))
    return tuple(p for p in parts if p is not None)


@functools.lru_cache(maxsize=1024)
def split_for_overlap(calls: tuple[BlockCall, ...]) -> tuple[tuple[BlockCall, ...], tuple[BlockCall, ...]]:
    """``(head, tail)``: ``calls`` cut into a small first part (about a quarter of the pairs) and the rest.

    The ring backward runs the head while the first remote K/V arrive and the tail while the last
    dK/dV travel home.  Several calls are cut between calls; a single call is cut at its middle row
    (the zigzag local block: the first chunk's causal diagonal, then the second chunk's rows).
    """
    if len(calls) == 1:
        c = calls[0]
        parts = split_rows(c, (c.q_lo + c.q_hi) // 2)
        return parts[:1], parts[1:]
    total, running = sum(c.pairs for c in calls), 0
    for i, c in enumerate(calls):
        running += c.pairs
        if 4 * running >= total:
            return calls[:i + 1], calls[i + 1:]
    return calls, ()


def whole(calls: tuple[BlockCall, ...], s_q: int, s_k: int) -> bool:
    """One call over every query row and key row: its kernel result is the whole answer."""
    return len(calls) == 1 and (calls[0].q_lo, calls[0].q_hi, calls[0].k_lo, calls[0].k_hi) == (0, s_q, 0, s_k)
