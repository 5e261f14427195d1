"""The block schedules and ring schedules: exact coverage, coalescing, skipped steps, bytes on the wire."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from megatron_longctx.attention import cp_attention, schedule_flops, shard_sequence
from megatron_longctx.attention.comm import STATS
from megatron_longctx.attention import layout as layout_module
from megatron_longctx.attention.layout import Packing, SeqLayout, dense_layout, from_ranks, pooled_index, to_ranks
from megatron_longctx.attention.schedule import allgather_calls, ring_schedule
from megatron_longctx.attention.segments import Segment, local_offsets
from megatron_longctx.kernels.base import BlockMask
from tests.dist import run_ranks

MASKS = [BlockMask(True), BlockMask(False), BlockMask(True, (2, -1)), BlockMask(True, (4, 0)),
         BlockMask(False, (1, 2)), BlockMask(False, (-1, 0)), BlockMask(True, (0, 0)), BlockMask(False, (5, 3))]


def _true_mask(mask: BlockMask, s: int) -> torch.Tensor:
    diff = torch.arange(s)[:, None] - torch.arange(s)[None, :]  # query - key position
    visible = torch.ones(s, s, dtype=torch.bool)
    if mask.left >= 0:
        visible &= diff <= mask.left
    if mask.right >= 0:
        visible &= -diff <= mask.right
    return visible


def _positions(segs) -> torch.Tensor:
    return torch.cat([torch.arange(s.start, s.start + s.length) for s in segs])


def _ring_calls(layout, mask: BlockMask):
    sched = ring_schedule(layout, mask)
    for i, t in enumerate(sched.offsets):
        for r in range(layout.cp_size):
            yield r, layout.segments(0, (r - t) % layout.cp_size), sched.calls[i][r]


def _allgather_calls(layout, mask: BlockMask):
    for r in range(layout.cp_size):
        yield r, (Segment(0, layout.global_len),), allgather_calls(layout, r, mask)


@pytest.mark.parametrize("calls_of", [_ring_calls, _allgather_calls])
def test_every_visible_pair_computed_exactly_once(calls_of):
    """Each call's mask, as the kernel applies it, is the true mask; the calls tile the visible pairs."""
    for cp, chunk, zigzag, mask in itertools.product([1, 2, 3, 4], [1, 2, 3], [True, False], MASKS):
        layout = dense_layout(cp, chunk, zigzag)
        truth = _true_mask(mask, layout.global_len)
        count = torch.zeros_like(truth, dtype=torch.int64)
        for rank, k_segs, calls in calls_of(layout, mask):
            q_pos, k_pos = _positions(layout.segments(0, rank)), _positions(k_segs)
            for c in calls:
                rows, cols = q_pos[c.q_lo:c.q_hi, None], k_pos[None, c.k_lo:c.k_hi]
                seen = c.mask.dense(c.q_start, c.q_hi - c.q_lo, c.k_start, c.k_hi - c.k_lo)
                assert torch.equal(seen, truth[rows, cols]), (layout, mask, rank, c)
                assert c.pairs == int(seen.sum())
                count[rows, cols] += seen.long()
        assert torch.equal(count, truth.long()), (layout, mask)


def test_zigzag_ring_step_is_one_kernel_call():
    for cp in (2, 4, 8):
        sched = ring_schedule(dense_layout(cp, 16), BlockMask(True))
        assert sched.offsets == tuple(range(cp))
        assert all(len(calls) == 1 for step in sched.calls for calls in step)


@pytest.mark.parametrize("mask,offsets", [
    (BlockMask(True), (0, 1, 2, 3)),
    (BlockMask(True, (2, 0)), (0, 1, 3)),  # neighbours of chunk r / 2cp-1-r live on ranks r-1 / r+1
    (BlockMask(True, (0, 0)), (0,)),  # every query sees itself only: no transfer at all
    (BlockMask(False, (1, 1)), (0, 1, 3)),
    (BlockMask(True, (4, 0)), (0, 1, 2, 3)),  # reaches two chunks back
])
def test_ring_skips_offsets_outside_the_window(mask, offsets):
    sched = ring_schedule(dense_layout(4, 3), mask)
    assert sched.offsets == offsets
    assert sched.transfers == len(offsets) - 1


def test_schedule_flops_balance():
    for cp in (2, 4, 8):
        zigzag = schedule_flops("ring", cp, 64 * cp, heads=2, d_qk=4)
        naive = schedule_flops("ring", cp, 64 * cp, heads=2, d_qk=4, zigzag=False)
        s = 64 * cp
        assert sum(zigzag) == sum(naive) == 2 * (4 + 4) * 2 * s * (s + 1) // 2
        assert max(zigzag) == min(zigzag)
        assert max(naive) / (sum(naive) / cp) > 1.4  # -> (2cp-1)/cp for long sequences
        assert schedule_flops("allgather", cp, s, heads=2, d_qk=4) == zigzag
        assert sum(schedule_flops("ulysses", cp, s, heads=2 * cp, d_qk=4)) == sum(zigzag) * cp


@pytest.mark.parametrize("max_runs", [layout_module.MAX_COPY_RUNS, 0], ids=["run-copies", "one-gather"])
def test_natural_order_roundtrip(monkeypatch, max_runs):
    monkeypatch.setattr(layout_module, "MAX_COPY_RUNS", max_runs)
    for cp, b in itertools.product([1, 2, 3, 4], [1, 2]):
        x = torch.randn(b, 2 * cp * 3, 5)  # [b, s, rest]
        shards = torch.stack([shard_sequence(x, r, cp, seq_dim=1) for r in range(cp)])  # [cp, b, s/cp, rest]
        index = pooled_index(dense_layout(cp, 3), cp)
        assert torch.equal(from_ranks(shards, index), x)
        assert torch.equal(to_ranks(x, cp, index), shards)
        expected = [0, 6] if cp == 1 else [0, 3, 6]  # one rank holds the sequence as one run
        assert local_offsets(dense_layout(cp, 3).segments(0, 0)) == expected


def _wire_bytes():
    """Bytes each rank sends per algorithm, forward and backward, against closed forms."""
    p, rank = dist.get_world_size(), dist.get_rank()
    s, b, hq, hkv, d = 2 * p * 3, 2, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, h, d, generator=gen) for h in (hq, hkv, hkv))
    nq, nkv = q.numel() // p, 2 * k.numel() // p  # local elements of q, of k and v together
    e, acc = 4, 4  # float32 inputs; dK/dV travel in float32 too
    f = 2 if p == 4 else 1  # Ulysses K/V head replication: smallest f with h_kv * f % P == 0
    expected = {
        "ring": ((p - 1) * nkv * e, (p - 1) * nkv * e + (p - 1) * nkv * acc),
        "allgather": ((p - 1) * nkv * e, (p - 1) * nkv * e + (p - 1) * nkv * acc),
        # forward q, k, v in and out back; backward dout in, dq, dk, dv back.  Each all-to-all keeps
        # 1/P of its buffer; K/V heads are replicated f times when h_kv = 2 < P = 4.
        "ulysses": ((p - 1) * (nq + nkv * f + nq) * e // p,) * 2,
    }
    results = {}
    runs = [("ring", None), ("allgather", None), ("ulysses", None), ("ring", (2, 0)), ("ring", (0, 0))]
    for algorithm, window in runs:
        local = [shard_sequence(t, rank, p, 0).requires_grad_() for t in (q, k, v)]
        STATS.reset()
        out = cp_attention(*local, dist.group.WORLD, algorithm=algorithm, window_size=window)
        fwd = (STATS.total_bytes(), STATS.ops["p2p"])
        STATS.reset()
        out.sum().backward()
        bwd = (STATS.total_bytes(), STATS.ops["p2p"])
        results[(algorithm, window)] = (fwd, bwd)
        if window is None:
            assert (fwd[0], bwd[0]) == expected[algorithm], (algorithm, fwd, bwd, expected[algorithm])
    # A window of 2 needs ring offsets {0, 1, 3}: 2 K/V messages forward; backward 2 K/V + 2 dK/dV.
    assert [r[1] for r in results[("ring", (2, 0))]] == [2, 4]
    assert results[("ring", (0, 0))] == ((0, 0), (0, 0))
    assert [r[1] for r in results[("ring", None)]] == [p - 1, 2 * (p - 1)]
    return True


def test_bytes_on_the_wire_match_the_schedule():
    assert run_ranks(4, _wire_bytes) == [True] * 4


def _kernel_calls_per_ring_step():
    """Kernel calls the dense zigzag ring runs, forward and backward, counted where they are made."""
    from megatron_longctx.attention import block_loop

    p, rank = dist.get_world_size(), dist.get_rank()
    counts = {"forward": 0, "backward": 0}
    original = block_loop.kernel_for

    def counting_kernel_for(*args, **kwargs):
        kernel = original(*args, **kwargs)

        class Counted:
            def forward(self, *a, **kw):
                counts["forward"] += 1
                return kernel.forward(*a, **kw)

            def backward(self, *a, **kw):
                counts["backward"] += 1
                return kernel.backward(*a, **kw)

        return Counted()

    block_loop.kernel_for = counting_kernel_for
    try:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(2 * p * 8, 1, 2, 4, generator=gen) for _ in range(3))
        local = [shard_sequence(t, rank, p, 0).requires_grad_() for t in (q, k, v)]
        cp_attention(*local, dist.group.WORLD, algorithm="ring").sum().backward()
    finally:
        block_loop.kernel_for = original
    return counts


@pytest.mark.parametrize("world_size", [2, 4])
def test_dense_zigzag_ring_runs_one_kernel_call_per_step(world_size):
    steps = world_size  # causal zigzag: every offset has work
    # backward: the local block in two parts, before and after the remote steps (split_for_overlap)
    want = {"forward": steps, "backward": steps + 1}
    assert run_ranks(world_size, _kernel_calls_per_ring_step) == [want] * world_size


@pytest.mark.parametrize("cp,u", [(2, 2), (4, 2), (4, 4)])
def test_run_copies_match_the_gather_for_packed_documents(cp, u):
    """Packed documents of unequal lengths: the run-by-run copies give the gather's tensors, both ways."""
    lengths = [2 * cp * n for n in (3, 1, 5, 2)]  # padded document lengths
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    layout = SeqLayout(Packing.from_cu_seqlens(cu, cu), cp)
    index = pooled_index(layout, u)
    assert 1 < len(index.runs) <= layout_module.MAX_COPY_RUNS
    x = torch.randn(u, 2, layout.local_len, 3)  # [U, b, t, rest]
    gathered = x.transpose(0, 1)[:, index.member, index.token]  # [b, U*t, rest]
    assert torch.equal(from_ranks(x, index), gathered)
    assert torch.equal(to_ranks(gathered, u, index), x)
