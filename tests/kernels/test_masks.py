"""BlockMask's classifications and sub-blocks against its dense mask, on many random blocks."""

import random

import pytest
import torch

from megatron_longctx.kernels import BlockArgs, BlockMask, Visibility
from megatron_longctx.kernels.driver import flash2_pieces

from .cases import visible_pairs
from .flash_emulation import band, flash2_visible


def random_blocks(n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        mask = BlockMask(
            causal=rng.random() < 0.5, window=(rng.choice([-1, 0, 1, 2, 5, 9]), rng.choice([-1, 0, 1, 3, 7]))
        )
        yield mask, rng.randint(0, 20), rng.randint(0, 12), rng.randint(0, 20), rng.randint(0, 12)


def test_dense_follows_the_definition():
    for mask, qs, ql, ks, kl in random_blocks(500, seed=1):
        assert torch.equal(mask.dense(qs, ql, ks, kl), visible_pairs(mask, qs, ql, ks, kl)), (mask, qs, ql, ks, kl)


def test_visibility_agrees_with_dense():
    seen_kinds = set()
    for mask, qs, ql, ks, kl in random_blocks(3000, seed=2):
        dense = mask.dense(qs, ql, ks, kl)
        kind = mask.visibility(qs, ql, ks, kl)
        seen_kinds.add(kind)
        assert (kind is Visibility.NONE) == (not dense.any()), (mask, qs, ql, ks, kl)
        assert (kind is Visibility.FULL) == (dense.numel() > 0 and dense.all()), (mask, qs, ql, ks, kl)
    assert seen_kinds == set(Visibility)


def test_live_block_holds_every_visible_pair_as_a_band():
    for mask, qs, ql, ks, kl in random_blocks(3000, seed=3):
        dense = mask.dense(qs, ql, ks, kl)
        live = mask.live_block(qs, ql, ks, kl)
        if live is None:
            assert not dense.any()
            continue
        sub = dense[live.q_lo : live.q_hi, live.k_lo : live.k_hi]
        assert sub.sum() == dense.sum(), "a visible pair lies outside the live block"
        assert sub.any(dim=1).all() and sub.any(dim=0).all(), "the live block has a dead row or key"
        assert torch.equal(band(live.s_q, live.s_k, live.band_lo, live.band_hi), sub)
        assert torch.equal(live.dense(), sub)
        assert live.is_full == bool(sub.all())


def test_flash_window_is_bottom_right_aligned_and_exact():
    for mask, qs, ql, ks, kl in random_blocks(3000, seed=4):
        live = mask.live_block(qs, ql, ks, kl)
        if live is None:
            continue
        causal, left, right = live.flash_window()
        if causal:
            assert (left, right) == (-1, -1)
            right = 0
        assert left >= -1 and right >= -1
        # flash-attn: row i sees j in [i + s_k - s_q - left, i + s_k - s_q + right]
        shift = live.s_k - live.s_q
        lo = None if left < 0 else shift - left
        hi = None if right < 0 else shift + right
        assert torch.equal(band(live.s_q, live.s_k, lo, hi), live.dense()), live


def test_flash2_pieces_survive_flash_attn_2_rewrites():
    unsafe_before_split = 0
    for mask, qs, ql, ks, kl in random_blocks(3000, seed=5):
        dense = mask.dense(qs, ql, ks, kl)
        live = mask.live_block(qs, ql, ks, kl)
        if live is not None and not torch.equal(flash2_visible(live.s_q, live.s_k, *live.flash_window()), live.dense()):
            unsafe_before_split += 1
        covered = torch.zeros_like(dense, dtype=torch.int64)
        for piece in flash2_pieces(BlockArgs(1.0, mask, qs, ks), ql, kl):
            got = flash2_visible(piece.s_q, piece.s_k, *piece.flash_window())
            assert torch.equal(got, piece.dense()), piece
            covered[piece.q_lo : piece.q_hi, piece.k_lo : piece.k_hi] += got
        assert (covered <= 1).all(), "pieces overlap"
        assert torch.equal(covered.bool(), dense)
    assert unsafe_before_split > 0, "the random blocks never exercise the row split"


@pytest.mark.parametrize("q_len, k_len", [(0, 4), (4, 0), (0, 0)])
def test_empty_blocks_are_invisible(q_len, k_len):
    mask = BlockMask(causal=False)
    assert mask.visibility(0, q_len, 0, k_len) is Visibility.NONE
    assert mask.live_block(0, q_len, 0, k_len) is None
