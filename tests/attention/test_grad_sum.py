"""The backward's building blocks: gradient sums without zero fills, the local block cut in two, pair counts.

:class:`GradSum` against plain zero-initialised sums; :func:`split_for_overlap` against the true mask
(every visible pair in exactly one part) and, run through the block kernels, against float64 autograd
attention over the whole local block.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from megatron_longctx.attention.block_loop import GradSum, Rows, attend_segments_backward
from megatron_longctx.attention.layout import dense_layout
from megatron_longctx.attention.schedule import ring_schedule
from megatron_longctx.attention.segments import split_for_overlap, visible_pairs
from megatron_longctx.kernels.base import BlockMask
from tests.oracle import attention, visible

MASKS = [BlockMask(True), BlockMask(False), BlockMask(True, (2, 0)), BlockMask(True, (4, 0)),
         BlockMask(False, (1, 2)), BlockMask(True, (0, 0)), BlockMask(False, (5, 3))]


SPANS = [[(0, 10)], [(2, 5), (0, 3), (7, 9)], [(4, 6), (4, 6), (1, 8)], [], [(0, 10), (3, 4)]]


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("spans", SPANS, ids=str)
def test_grad_sum_matches_a_zero_filled_sum(spans, flat):
    gen = torch.Generator().manual_seed(0)
    shapes = [torch.Size([2, 10, 3, 4]), torch.Size([2, 10, 3, 5])]
    acc = GradSum(shapes, torch.float64, torch.device("cpu"), flat=flat)
    want = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for lo, hi in spans:
        grads = [torch.randn(s[0], hi - lo, *s[2:], generator=gen, dtype=torch.float64) for s in shapes]
        acc.add(lo, hi, grads)
        for w, g in zip(want, grads):
            w[:, lo:hi] += g
    got = acc.result()
    for g, w in zip(got, want):
        assert_close(g, w, rtol=0, atol=0)
    if flat:
        assert_close(acc.message(), torch.cat([w.flatten() for w in want]), rtol=0, atol=0)


def test_grad_sum_takes_a_whole_first_contribution_without_copy():
    g = torch.randn(1, 6, 2, 3, dtype=torch.float32)
    acc = GradSum([g.shape], torch.float32, g.device)
    acc.add(0, 6, [g])
    (got,) = acc.result()
    assert got is g
    narrow = GradSum([g.shape], torch.float64, g.device)  # another dtype: copied, then summed in float64
    narrow.add(0, 6, [g])
    narrow.add(1, 3, [g[:, :2]])
    (got,) = narrow.result()
    assert got.dtype == torch.float64 and got is not g
    want = g.double().clone()
    want[:, 1:3] += g[:, :2].double()
    assert_close(got, want, rtol=0, atol=0)


def test_split_for_overlap_tiles_each_local_block():
    """Head and tail together hold every visible pair of the local step exactly once, each with its true mask."""
    for cp, chunk, mask in itertools.product([1, 2, 3, 4], [1, 2, 3, 5], MASKS):
        layout = dense_layout(cp, chunk)
        sched = ring_schedule(layout, mask)
        for rank in range(cp):
            pos = torch.cat([torch.arange(s.start, s.start + s.length) for s in layout.segments(0, rank)])
            truth = visible(pos, pos, mask.causal, mask.window)
            head, tail = split_for_overlap(sched.calls[0][rank])
            count = torch.zeros_like(truth, dtype=torch.int64)
            for c in head + tail:
                seen = c.mask.dense(c.q_start, c.q_hi - c.q_lo, c.k_start, c.k_hi - c.k_lo)
                assert torch.equal(seen, truth[c.q_lo:c.q_hi, c.k_lo:c.k_hi]), (cp, chunk, mask, rank, c)
                assert c.pairs == int(seen.sum())
                count[c.q_lo:c.q_hi, c.k_lo:c.k_hi] += seen.long()
            assert torch.equal(count, truth.long()), (cp, chunk, mask, rank)
            if mask == BlockMask(True):  # zigzag, causal: the head is the first chunk's diagonal
                assert sum(c.pairs for c in head) == chunk * (chunk + 1) // 2


@pytest.mark.parametrize("backend", ["cpu_flash", "reference"])
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_split_local_block_gradients_match_float64(mask, backend):
    """The two parts' gradients, summed by GradSum, are the gradients of the whole local block (GQA, d_qk != d_v)."""
    layout, rank, scale = dense_layout(2, 5), 1, 0.3
    calls = ring_schedule(layout, mask).calls[0][rank]
    head, tail = split_for_overlap(calls)
    assert head and tail
    gen = torch.Generator().manual_seed(1)
    t = layout.local_len
    q, k, v, dout = (torch.randn(1, t, h, d, generator=gen, dtype=torch.float64)
                     for h, d in ((4, 8), (2, 8), (2, 6), (4, 6)))
    pos = torch.cat([torch.arange(s.start, s.start + s.length) for s in layout.segments(0, rank)])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = attention(*leaves, scale, visible(pos, pos, mask.causal, mask.window))
    want = torch.autograd.grad(out, leaves, dout)
    dq = GradSum([q.shape], torch.float64, q.device)
    dkv = GradSum([k.shape, v.shape], torch.float64, q.device, flat=True)
    out, lse = out.detach(), lse.detach()
    for part in (head, tail):
        attend_segments_backward(Rows(q, out, lse, dout), k, v, part, scale, backend, dq, dkv)
    for got, ref in zip(dq.result() + dkv.result(), want):
        assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_visible_pairs_counts_the_dense_mask():
    """The closed form against the mask itself: blocks before, across and after the diagonal, any window."""
    masks = MASKS + [BlockMask(False, (-1, 0)), BlockMask(False, (0, -1)), BlockMask(False, (2, 7)), BlockMask(False)]
    for mask, q_start, q_len, k_start, k_len in itertools.product(masks, [0, 3, 9], [0, 1, 4, 7], [0, 2, 6, 11],
                                                                  [0, 1, 5, 8]):
        want = int(mask.dense(q_start, q_len, k_start, k_len).sum()) if q_len and k_len else 0
        assert visible_pairs(mask, q_start, q_len, k_start, k_len) == want, (mask, q_start, q_len, k_start, k_len)
