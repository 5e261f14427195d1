"""Packed (THD) layout, sharding and block schedules: single process, no ranks.

The per-document split is checked against Transformer Engine's ``thd_get_partitioned_indices`` rule
(written out here from its definition) and against Megatron-Core's own THD RoPE slicing; the schedules
against brute-force pair counts; the bad inputs against their ValueErrors.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.testing import assert_close

from megatron_longctx.attention.packed import (
    Packing,
    SeqLayout,
    cp_attention_packed,
    gather_packed_shards,
    group_order,
    pad_packed,
    packed_batch_on_this_cp_rank,
    packed_pairs,
    packed_position_ids,
    partition_index,
    real_token_mask,
    shard_packed,
    unpad_packed,
)
from megatron_longctx.attention.schedule import ring_schedule
from megatron_longctx.kernels.base import BlockMask
from tests.oracle import document_attention

LENGTHS = [(1,), (1, 7, 2, 16), (33, 1, 1, 5), (13,)]


def te_partitioned_indices(cu_seqlens_padded: list[int], cp: int, rank: int) -> list[int]:
    """Transformer Engine's rule: local token i of document s sits in chunk ``rank`` (first half of the
    document's local run) or ``2cp-1-rank`` (second half)."""
    index = []
    for start, end in zip(cu_seqlens_padded, cu_seqlens_padded[1:]):
        local = (end - start) // cp
        for i in range(local):
            chunk = rank if i < local // 2 else 2 * cp - 1 - rank
            index.append(start + i % (local // 2) + chunk * (local // 2))
    return index


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("lengths", LENGTHS)
def test_partition_matches_te_rule_and_round_trips(cp, lengths):
    packing = Packing.from_lengths(lengths, cp)
    layout = SeqLayout(packing, cp)
    x = torch.randn(packing.padded_total, 3)
    shards = []
    for r in range(cp):
        assert partition_index(layout, r).tolist() == te_partitioned_indices(list(packing.cu_seqlens_padded), cp, r)
        shards.append(shard_packed(x, packing, r, cp))
        assert shards[-1].shape == (packing.padded_total // cp, 3)
    assert torch.equal(gather_packed_shards(shards, packing), x)
    for u in (d for d in range(1, cp + 1) if cp % d == 0):
        for g in range(cp // u):
            pooled = torch.cat(shards[g * u:(g + 1) * u])[group_order(layout, u)]
            assert torch.equal(pooled, shard_packed(x, packing, g, cp // u)), (u, g)


@pytest.mark.parametrize("cp", [2, 4])
def test_shards_match_megatron_thd_rope_slicing(cp):
    """Megatron's THD RoPE on a shard (with global cu_seqlens_padded) == our shard of RoPE on the whole."""
    rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")

    class FakeGroup:
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def rank(self):
            return self._rank

    packing = Packing.from_lengths((5, 1, 2 * cp * 3 - 1, 2), cp)
    cu = torch.tensor(packing.cu_seqlens_padded, dtype=torch.int32)
    d = 8
    max_len = max(packing.padded_lengths)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # [max_s, d/2]
    freqs = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [max_s, 1, 1, d]
    t = torch.randn(packing.padded_total, 2, d, dtype=torch.float64)
    whole = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=FakeGroup(1, 0))
    for r in range(cp):
        local = rope_utils._apply_rotary_pos_emb_thd(shard_packed(t, packing, r, cp), cu, freqs,
                                                     cp_group=FakeGroup(cp, r))
        assert_close(local, shard_packed(whole, packing, r, cp), atol=1e-12, rtol=1e-12)


def test_padding_helpers_and_batch():
    cp = 2
    packing = Packing.from_lengths((3, 1, 6), cp)  # slots 4, 4, 8
    assert packing.cu_seqlens_padded == (0, 4, 8, 16)
    real = torch.arange(1, packing.total + 1)
    padded = pad_packed(real, packing, value=-1)
    assert padded.tolist() == [1, 2, 3, -1, 4, -1, -1, -1, 5, 6, 7, 8, 9, 10, -1, -1]
    assert torch.equal(unpad_packed(padded, packing), real)
    assert torch.equal(real_token_mask(packing), padded >= 0)
    assert packed_position_ids(packing).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]

    batch = {"tokens": padded[None], "labels": padded[None] + 100, "loss_mask": None, "position_ids": None,
             "attention_mask": None}
    for r in range(cp):
        local, fields = packed_batch_on_this_cp_rank(batch, packing, r, cp)
        index = partition_index(SeqLayout(packing, cp), r)
        assert torch.equal(local["tokens"][0], padded[index])
        assert torch.equal(local["labels"][0], padded[index] + 100)
        assert torch.equal(local["loss_mask"][0], (padded[index] >= 0).float())
        assert torch.equal(local["position_ids"][0], packed_position_ids(packing)[index])
        assert local["attention_mask"] is None
        assert fields.qkv_format == "thd" and fields.max_seqlen_q == fields.max_seqlen_kv == 8
        assert fields.cu_seqlens_q.tolist() == [0, 3, 4, 10] and fields.cu_seqlens_q.dtype == torch.int32
        assert fields.cu_seqlens_kv_padded.tolist() == [0, 4, 8, 16]


def _brute_pairs(packing: Packing, mask: BlockMask) -> int:
    total = 0
    for n in packing.lengths:
        pos = torch.arange(n)
        gap = pos[:, None] - pos[None, :]
        visible = torch.ones(n, n, dtype=torch.bool)
        if mask.left >= 0:
            visible &= gap <= mask.left
        if mask.right >= 0:
            visible &= -gap <= mask.right
        total += int(visible.sum())
    return total


@pytest.mark.parametrize("mask", [BlockMask(True), BlockMask(False), BlockMask(True, (2, 0)), BlockMask(False, (1, 3))])
def test_schedules_cover_each_document_pair_once(mask):
    cp = 4
    packing = Packing.from_lengths((1, 7, 40, 3, 9), cp)
    layout = SeqLayout(packing, cp)
    expected = _brute_pairs(packing, mask)
    for algorithm, u in (("ring", 1), ("allgather", 1), ("ulysses", 1), ("hybrid", 2)):
        pairs = packed_pairs(algorithm, layout, mask, ulysses_size=u)
        assert sum(pairs) == pytest.approx(expected), algorithm


def test_ring_skips_offsets_without_visible_pairs():
    cp = 4
    layout = SeqLayout(Packing.from_lengths((64, 13), cp), cp)
    # A window of 2 on chunks of 8 and 2 tokens: only neighbouring chunks meet, on ranks r-1, r, r+1.
    assert ring_schedule(layout, BlockMask(True, (2, 0))).offsets == (0, 1, 3)
    # Chunks of 1 token (a 5-token document): a query also sees the chunk two back, on rank r-2.
    short = SeqLayout(Packing.from_lengths((64, 5), cp), cp)
    assert ring_schedule(short, BlockMask(True, (2, 0))).offsets == (0, 1, 2, 3)
    assert ring_schedule(layout, BlockMask(True)).offsets == (0, 1, 2, 3)
    # Single-token documents: every rank but 0 holds only padding, and rank 0 sees only itself.
    tiny = SeqLayout(Packing.from_lengths((1, 1, 1), cp), cp)
    schedule = ring_schedule(tiny, BlockMask(True))
    assert schedule.offsets == (0,) and [len(c) for c in schedule.calls[0]] == [3, 0, 0, 0]


def test_local_packed_attention_matches_reference():
    packing = Packing.from_lengths((1, 5, 9), 1)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(packing.padded_total, h, 8, generator=gen, dtype=torch.float64)
                     for h in (4, 2, 2, 4))
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = cp_attention_packed(*inputs, None, packing, algorithm="ring", window_size=(3, 0))
    out.backward(dout)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = document_attention(*ref_in, packing, True, (3, 0), 8 ** -0.5)
    ref.backward(dout)
    assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for x, r in zip(inputs, ref_in):
        assert_close(x.grad, r.grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("cu_seqlens, cu_seqlens_padded, match", [
    ([0, 5, 3], None, r"cu_seqlens must be non-decreasing.*cu_seqlens\[2\]=3 < cu_seqlens\[1\]=5"),
    ([1, 5], None, "cu_seqlens=.*must start at 0"),
    ([0], None, "at least two offsets"),
    ([0, 4, 8], [0, 4], "same documents"),
    ([0, 5, 8], [0, 4, 8], "document 0 has 5 tokens .* slot of only 4"),
    (torch.tensor([[0.0, 4.0]]), None, "integer tensor"),
])
def test_bad_packing_raises(cu_seqlens, cu_seqlens_padded, match):
    with pytest.raises(ValueError, match=match):
        Packing.from_cu_seqlens(cu_seqlens, cu_seqlens_padded)


def test_bad_inputs_raise():
    packing = Packing.from_cu_seqlens(torch.tensor([0, 3, 8], dtype=torch.int32),
                                      torch.tensor([0, 4, 12], dtype=torch.int32))
    with pytest.raises(ValueError, match="document 0 has a padded length of 4 .* not a multiple of 2\\*cp=16"):
        SeqLayout(packing, 8)  # slots of 4 and 8 tokens cannot split into 16 chunks
    x = torch.zeros(12, 2, 4)
    with pytest.raises(ValueError, match=r"x.shape\[0\]=11 must equal cu_seqlens_padded\[-1\]=12"):
        shard_packed(x[:11], packing, 0, 2)
    with pytest.raises(ValueError, match=r"cp_rank=2 must lie in \[0, cp_size=2\)"):
        shard_packed(x, packing, 2, 2)
    with pytest.raises(ValueError, match=r"q.shape\[0\]=10 local tokens.*cu_seqlens_padded\[-1\]=12"):
        cp_attention_packed(x[:10], x[:10], x[:10], None, packing, algorithm="ring")
    with pytest.raises(ValueError, match=r"must be \[t, h, d\]"):
        cp_attention_packed(x[None], x[None], x[None], None, packing, algorithm="ring")
    with pytest.raises(ValueError, match="algorithm='zigzag'"):
        cp_attention_packed(x, x, x, None, packing, algorithm="zigzag")
    with pytest.raises(ValueError, match="no real token"):
        cp_attention_packed(x[:4], x[:4], x[:4], None, Packing.from_cu_seqlens([0, 0], [0, 4]), algorithm="ring")
    with pytest.raises(ValueError, match="packing must be a Packing"):
        cp_attention_packed(x, x, x, None, [0, 3, 8], algorithm="ring")

    class Params:
        cu_seqlens_q = torch.tensor([0, 3, 8])
        cu_seqlens_kv = torch.tensor([0, 4, 8])
        cu_seqlens_q_padded = cu_seqlens_kv_padded = None

    with pytest.raises(ValueError, match="cu_seqlens_kv.*equal to cu_seqlens_q"):
        Packing.from_packed_seq_params(Params)
    Params.cu_seqlens_kv = Params.cu_seqlens_q
    assert Packing.from_packed_seq_params(Params).lengths == (3, 5)


def test_from_lengths_pads_each_document():
    for cp, lengths in itertools.product((1, 2, 4), LENGTHS):
        packing = Packing.from_lengths(lengths, cp)
        assert packing.lengths == lengths
        assert all(p % (2 * cp) == 0 and 0 <= p - n < 2 * cp for p, n in zip(packing.padded_lengths, lengths))


def test_balance_bench_counts_the_same_work_and_balances_it(tmp_path):
    from megatron_longctx.bench import packed_balance_bench as bench

    cp, mask = 4, BlockMask(True)
    res = bench.measure([256] + [16] * 16, cp, mask, heads=2, head_dim=4)
    totals = {s: sum(v["flops_per_rank"]) for s, v in res["schemes"].items()}
    packing = Packing.from_lengths([256] + [16] * 16, cp)
    assert set(totals.values()) == {_brute_pairs(packing, mask) * 4 * 4 * 2}
    assert res["schemes"]["zigzag-doc"]["max_over_min"] == 1.0  # every document length divisible by 2*cp
    assert res["schemes"]["contiguous"]["max_over_min"] > 10
    assert res["kernel_calls_per_rank"] == [17 * cp] * cp
    # a variable-length backend: one call per step (each step's blocks are all of one kind)
    assert res["varlen_calls_per_rank"] == [cp] * cp
