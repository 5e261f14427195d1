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

from . import flash_attn_releases as releases
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
    return _module("sdpa_cuda", ops.kernel())


def _module(name: str, kernel) -> types.SimpleNamespace:
    return flash_emulation.emulated_backend(name, kernel)


def _release_kernel(release: str):
    return releases.fa3_kernel() if release == "fa3" else releases.fa2_kernel(release)


RELEASES = ["2.5.0", "2.6.3", "2.7.4", "2.8.3", "fa3"]


@pytest.mark.parametrize("release", RELEASES)
def test_flash_attn_releases_blocks_in_one_call_per_kind(release):
    """Every flash-attn release's varlen schema (emulated): one call per kind, each block as float64."""
    b, hq, hkv, d = 2, 4, 2, 16
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(b, 64, hq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, 60, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(b, 64, hq, d, generator=gen, dtype=torch.float64)
    blocks = _blocks(d ** -0.5)
    kernel = _release_kernel(release)
    before = dict(releases.CALLS)
    got = kernel.forward_blocks(q, k, v, blocks)
    out = torch.zeros(b, 64, hq, d, dtype=torch.float64)
    lse = torch.full((b, hq, 64), float("-inf"), dtype=torch.float64)
    for blk, (o, l) in zip(blocks, got):
        rows, keys = slice(blk.q_lo, blk.q_hi), slice(blk.k_lo, blk.k_hi)
        ref = reference.forward(q[:, rows], k[:, keys], v[:, keys], blk.args)
        assert_close(o, ref[0], rtol=1e-12, atol=1e-12)
        assert_close(l, ref[1], rtol=1e-12, atol=1e-12)
        out[:, rows], lse[:, :, rows] = o, l
    grads = kernel.backward_blocks(dout, q, k, v, out, lse, blocks)
    for blk, g in zip(blocks, grads):
        rows, keys = slice(blk.q_lo, blk.q_hi), slice(blk.k_lo, blk.k_hi)
        ref = reference.backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows],
                                 blk.args)
        for x, y in zip(g, ref):
            assert_close(x, y, rtol=1e-12, atol=1e-12)
    calls = {n: releases.CALLS[n] - before.get(n, 0) for n in ("forward", "backward", "varlen_forward",
                                                               "varlen_backward")}
    assert calls == {"forward": 0, "backward": 0, "varlen_forward": 3, "varlen_backward": 3}


class _Recorder:
    """Stands in for :class:`~megatron_longctx.kernels.varlen.HostCopies`: records every host-to-device copy,
    whether its source was pinned and whether the host waited for it."""

    def __init__(self):
        self.copies: list[tuple[bool, bool]] = []
        self._pinned: set[int] = set()

    def pin(self, t, device):
        self._pinned.add(id(t))
        return t

    def copy(self, t, device, non_blocking):
        self.copies.append((id(t) in self._pinned, non_blocking))
        return t

    def blocking(self, since: int = 0) -> int:
        return sum(1 for pinned, non_blocking in self.copies[since:] if not (pinned and non_blocking))


@pytest.mark.parametrize("release", ["sdpa_cuda", "2.5.0", "2.8.3"])
def test_packed_steps_copy_nothing_blocking_and_nothing_at_all_after_the_first(monkeypatch, release):
    recorder = _Recorder()
    monkeypatch.setattr(varlen, "COPIES", recorder)
    varlen._cu_seqlens.cache_clear()
    varlen._padded_rows.cache_clear()
    kernel = _Counted().kernel() if release == "sdpa_cuda" else _release_kernel(release)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 64, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 60, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    blocks = _blocks(8 ** -0.5)
    per_step = []
    for _ in range(3):  # three steps (layers) of one packing
        before = len(recorder.copies)
        out_lse = kernel.forward_blocks(q, k, v, blocks)
        out = torch.cat([o for o, _ in out_lse], dim=1)[:, :64]
        lse = torch.cat([l for _, l in out_lse], dim=-1)[..., :64]
        kernel.backward_blocks(q, q, k, v, out, lse, blocks)
        per_step.append((len(recorder.copies) - before, recorder.blocking(before)))
    assert per_step[0][0] > 0 and [s[1] for s in per_step] == [0, 0, 0]  # pinned, no host wait
    assert [s[0] for s in per_step[1:]] == [0, 0]  # the same packing: every tensor from the cache


def _packed_ring(lengths, causal, window, release="sdpa_cuda"):
    """64 documents at CP=4: an emulated flash backend against float64 ``reference``, and its calls."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    packing = Packing.from_lengths(lengths, cp)
    gen = torch.Generator().manual_seed(3)
    t = packing.padded_total
    q, k, v = (torch.randn(t, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn(t, 4, 8, generator=gen, dtype=torch.float64)
    results = {}
    ops = _Counted()
    per_step: list[tuple[int, int]] = []  # (blocks given, kernel calls made) per many-block forward
    backward_calls = []

    if release == "sdpa_cuda":
        name, fake = "sdpa_cuda", _emulated_sdpa(ops)
        forward_calls = lambda: ops.forward_calls  # noqa: E731
        backward_count = lambda: ops.backward_calls  # noqa: E731
    else:
        name, fake = "flash_attn", _module("flash_attn", _release_kernel(release))
        forward_calls = lambda: releases.CALLS["varlen_forward"] + releases.CALLS["forward"]  # noqa: E731
        backward_count = lambda: releases.CALLS["varlen_backward"] + releases.CALLS["backward"]  # noqa: E731

    def counting(many):
        @functools.wraps(many)
        def call(q_, k_, v_, blocks):
            before = forward_calls()
            out = many(q_, k_, v_, blocks)
            per_step.append((len(blocks), forward_calls() - before))
            return out
        return call

    fake.forward_blocks = counting(fake.forward_blocks)
    saved = select.BACKENDS[name]
    select.BACKENDS[name] = fake
    try:
        for backend in ("reference", name):
            if backend == name:
                backward_before = backward_count()
            local = [shard_packed(x, packing, rank, cp).requires_grad_() for x in (q, k, v)]
            out = cp_attention_packed(*local, dist.group.WORLD, packing, algorithm="ring", causal=causal,
                                      window_size=window, backend=backend)
            out.backward(shard_packed(dout, packing, rank, cp))
            results[backend] = [unshard_packed(x, packing, dist.group.WORLD)
                                for x in (out.detach(), *(x.grad for x in local))]
        backward_calls = backward_count() - backward_before
    finally:
        select.BACKENDS[name] = saved
    for got, ref in zip(results[name], results["reference"]):
        assert_close(got, ref, rtol=1e-10, atol=1e-10)
    mask = BlockMask(causal, window or (-1, -1))
    steps = len(schedule.ring_schedule(SeqLayout(packing, cp), mask).offsets)  # every rank runs every step
    return per_step, steps, backward_calls


@pytest.mark.parametrize("release", ["sdpa_cuda"] + RELEASES)
@pytest.mark.parametrize("causal,window", [(True, None), (True, (24, 0)), (False, None)],
                         ids=["causal", "window", "full"])
def test_a_packed_ring_step_is_a_few_kernel_calls_not_one_per_document(causal, window, release):
    lengths = tuple(16 + 8 * (i % 5) for i in range(64))  # 64 documents of 16-48 tokens
    per_rank = run_ranks(4, _packed_ring, lengths, causal, window, release)
    for per_step, steps, backward_calls in per_rank:
        assert len(per_step) == steps  # one many-block call per ring step
        assert max(blocks for blocks, _ in per_step) >= 16  # steps of many documents' blocks...
        assert all(calls <= 3 for _, calls in per_step), per_step  # ...in at most 3 kernel calls
        assert backward_calls <= 3 * steps
