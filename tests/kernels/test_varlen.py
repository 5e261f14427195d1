"""Many blocks in one call (``kernels.varlen``): torch's flash ops' variable-length entry point, driven on
the CPU through their float64 emulation (``flash_emulation``, the ops' exact schemas), against the same
backend block by block and against float64; and the kernel calls a packed ring step costs."""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_longctx.attention import schedule
from megatron_longctx.attention.layout import SeqLayout
from megatron_longctx.attention.packed import Packing, cp_attention_packed, shard_packed, unshard_packed
from megatron_longctx.kernels import driver, reference, sdpa_cuda, select, varlen
from megatron_longctx.kernels.base import BlockArgs, BlockMask
from tests.dist import run_ranks

from . import flash_emulation


class _Counted:
    """The emulated ops, counting calls (and the sequences each call carried)."""

    def __init__(self):
        self.forward_calls, self.backward_calls, self.sequences = 0, 0, []

    def fwd(self, *args, **kwargs):
        self.forward_calls += 1
        self.sequences.append(0 if args[3] is None else args[3].numel() - 1)
        return flash_emulation.flash_forward(*args, **kwargs)

    def bwd(self, *args, **kwargs):
        self.backward_calls += 1
        return flash_emulation.flash_backward(*args, **kwargs)

    def kernel(self) -> sdpa_cuda.FlashOpPieces:
        return sdpa_cuda.FlashOpPieces(self.fwd, self.bwd, windows=True)


def _blocks(scale: float) -> list[varlen.Block]:
    """Blocks of several documents laid end to end: unmasked, causal, one window, a causal block with more
    rows than keys (two flash-attn 2 pieces of two kinds), a window cutting both sides, a block whose rows
    see nothing (no piece)."""
    def blk(q_lo, q_hi, k_lo, k_hi, mask, q_start=0, k_start=0):
        return varlen.Block(q_lo, q_hi, k_lo, k_hi, BlockArgs(scale, mask, q_start, k_start))

    causal, full, win = BlockMask(True), BlockMask(False), BlockMask(True, (5, 0))
    return [
        blk(0, 7, 0, 7, causal),  # a document's diagonal block
        blk(7, 12, 7, 12, causal),  # the next document's
        blk(12, 20, 12, 16, full),  # unmasked, more rows than keys
        blk(20, 29, 16, 21, causal),  # causal, more rows than keys: two flash-attn 2 pieces (causal, unmasked)
        blk(29, 45, 25, 41, win),  # a window cutting both sides
        blk(45, 48, 41, 44, win, 0, 20),  # every key out of the window: no piece
        blk(48, 56, 44, 52, full),
        blk(56, 64, 52, 60, causal),
    ]


@pytest.mark.parametrize("shape", [(2, 4, 2, 16, 16), (1, 4, 1, 12, 8)], ids=["gqa-b2", "mqa-mla"])
def test_blocks_in_one_call_per_kind_match_each_block_and_float64(shape):
    b, hq, hkv, d_qk, d_v = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, 64, hq, d_qk, generator=gen, dtype=torch.float64)
    k = torch.randn(b, 60, hkv, d_qk, generator=gen, dtype=torch.float64)
    v = torch.randn(b, 60, hkv, d_v, generator=gen, dtype=torch.float64)
    dout = torch.randn(b, 64, hq, d_v, generator=gen, dtype=torch.float64)
    blocks = _blocks(d_qk ** -0.5)
    kinds = varlen.group_pieces(blocks, driver.flash2_pieces)
    assert len(kinds) == 3 and sum(map(len, kinds.values())) == 8  # causal, unmasked, the window

    ops = _Counted()
    got = ops.kernel().forward_blocks(q, k, v, blocks)
    assert ops.forward_calls == len(kinds) and ops.sequences == [b * len(s) for s in kinds.values()]
    out = torch.zeros(b, 64, hq, d_v, dtype=torch.float64)
    lse = torch.full((b, hq, 64), float("-inf"), dtype=torch.float64)
    for blk, (o, l) in zip(blocks, got):
        rows, keys = slice(blk.q_lo, blk.q_hi), slice(blk.k_lo, blk.k_hi)
        one = driver.forward(ops.kernel(), driver.flash2_pieces(blk.args, blk.q_hi - blk.q_lo, blk.k_hi - blk.k_lo),
                             q[:, rows], k[:, keys], v[:, keys], blk.args)
        ref = reference.forward(q[:, rows], k[:, keys], v[:, keys], blk.args)
        for x, y, z in zip((o, l), one, ref):
            assert_close(x, y, rtol=1e-12, atol=1e-13)  # the same sums, sequence by sequence (seen: 9e-16)
            assert_close(x, z, rtol=1e-12, atol=1e-12)
        out[:, rows], lse[:, :, rows] = o, l  # disjoint rows: each block's result is its rows' final one
    assert torch.isneginf(lse[:, :, 45:48]).all() and not out[:, 45:48].any()

    before = ops.backward_calls
    grads = ops.kernel().backward_blocks(dout, q, k, v, out, lse, blocks)
    assert ops.backward_calls - before == len(kinds)
    for blk, g in zip(blocks, grads):
        rows, keys = slice(blk.q_lo, blk.q_hi), slice(blk.k_lo, blk.k_hi)
        ref = reference.backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows],
                                 lse[:, :, rows], blk.args)
        for x, y in zip(g, ref):
            assert_close(x, y, rtol=1e-12, atol=1e-12)


def _emulated_sdpa(ops: _Counted) -> types.SimpleNamespace:
    """A ``sdpa_cuda`` backend on the CPU over the counted emulation (production arithmetic, emulated ops)."""
    kernel = ops.kernel()
    return types.SimpleNamespace(
        name="sdpa_cuda", available=lambda device: None, check=lambda q, k, v, args: None,
        forward=lambda q, k, v, args: driver.forward(kernel, driver.flash2_pieces(args, q.shape[1], k.shape[1]),
                                                     q, k, v, args),
        backward=lambda dout, q, k, v, out, lse, args: driver.backward(
            kernel, driver.flash2_pieces(args, q.shape[1], k.shape[1]), dout, q, k, v, out, lse, args),
        forward_blocks=kernel.forward_blocks, backward_blocks=kernel.backward_blocks)


def _packed_ring(lengths, causal, window):
    """64 documents at CP=4: the emulated flash backend against float64 ``reference``, and its calls."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    packing = Packing.from_lengths(lengths, cp)
    gen = torch.Generator().manual_seed(3)
    t = packing.padded_total
    q, k, v = (torch.randn(t, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn(t, 4, 8, generator=gen, dtype=torch.float64)
    results = {}
    ops = _Counted()
    per_step: list[tuple[int, int]] = []  # (blocks given, kernel calls made) per many-block forward

    def counting(many):
        @functools.wraps(many)
        def call(q_, k_, v_, blocks):
            before = ops.forward_calls
            out = many(q_, k_, v_, blocks)
            per_step.append((len(blocks), ops.forward_calls - before))
            return out
        return call

    fake = _emulated_sdpa(ops)
    fake.forward_blocks = counting(fake.forward_blocks)
    saved = select.BACKENDS["sdpa_cuda"]
    select.BACKENDS["sdpa_cuda"] = fake
    try:
        for backend in ("reference", "sdpa_cuda"):
            local = [shard_packed(x, packing, rank, cp).requires_grad_() for x in (q, k, v)]
            out = cp_attention_packed(*local, dist.group.WORLD, packing, algorithm="ring", causal=causal,
                                      window_size=window, backend=backend)
            out.backward(shard_packed(dout, packing, rank, cp))
            results[backend] = [unshard_packed(x, packing, dist.group.WORLD)
                                for x in (out.detach(), *(x.grad for x in local))]
    finally:
        select.BACKENDS["sdpa_cuda"] = saved
    for got, ref in zip(results["sdpa_cuda"], results["reference"]):
        assert_close(got, ref, rtol=1e-10, atol=1e-10)
    mask = BlockMask(causal, window or (-1, -1))
    steps = len(schedule.ring_schedule(SeqLayout(packing, cp), mask).offsets)  # every rank runs every step
    return per_step, steps, ops.backward_calls


@pytest.mark.parametrize("causal,window", [(True, None), (True, (24, 0)), (False, None)],
                         ids=["causal", "window", "full"])
def test_a_packed_ring_step_is_a_few_kernel_calls_not_one_per_document(causal, window):
    lengths = tuple(16 + 8 * (i % 5) for i in range(64))  # 64 documents of 16-48 tokens
    per_rank = run_ranks(4, _packed_ring, lengths, causal, window)
    for per_step, steps, backward_calls in per_rank:
        assert len(per_step) == steps  # one many-block call per ring step
        assert max(blocks for blocks, _ in per_step) >= 16  # steps of many documents' blocks...
        assert all(calls <= 3 for _, calls in per_step), per_step  # ...in at most 3 kernel calls
        assert backward_calls <= 3 * steps
