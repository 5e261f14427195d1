"""Ulysses' local attention: backward over head pieces, gradients written over the saved inputs.

:class:`HeadsAttention` must give the float64 gradients of attention over the whole sequence for MHA,
GQA and MQA (pieces of whole K/V heads, also of unequal widths; one K/V head is one piece), with windows and
``d_qk != d_v``; its returned dq lives in the saved q's memory (what saves the memory), and a second
backward through a retained graph fails instead of reading gradients as inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from megatron_longctx.attention.ulysses import HeadsAttention, head_pieces
from megatron_longctx.attention.args import attention_args
from megatron_longctx.attention.layout import SeqLayout
from megatron_longctx.attention.schedule import ring_schedule
from tests.oracle import sequence_attention


def test_head_pieces() -> None:
    assert head_pieces(8, 8) == [(slice(2 * i, 2 * i + 2), slice(2 * i, 2 * i + 2)) for i in range(4)]
    assert head_pieces(8, 2) == [(slice(0, 4), slice(0, 1)), (slice(4, 8), slice(1, 2))]
    assert head_pieces(6, 3) == [(slice(2 * i, 2 * i + 2), slice(i, i + 1)) for i in range(3)]
    assert head_pieces(10, 5) == [(slice(0, 2), slice(0, 1)), (slice(2, 4), slice(1, 2)), (slice(4, 6), slice(2, 3)),
                                  (slice(6, 10), slice(3, 5))]
    assert head_pieces(4, 1) == [(slice(0, 4), slice(0, 1))]
    assert head_pieces(1, 1) == [(slice(0, 1), slice(0, 1))]


def _run(hq, hkv, d_qk, d_v, causal, window, dtype, s=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1, s, hq, d_qk), (1, s, hkv, d_qk), (1, s, hkv, d_v)]
    leaves = [torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_() for shape in shapes]
    dout = torch.randn(1, s, hq, d_v, generator=gen, dtype=torch.float64)
    # the reference: float64 over [s, b, h, d] with the K/V heads expanded to their query groups
    q64, k64, v64 = (x.transpose(0, 1) for x in leaves)
    g = hq // hkv
    ref = sequence_attention(q64, k64.repeat_interleave(g, 2), v64.repeat_interleave(g, 2), causal, window,
                             1 / math.sqrt(d_qk)).transpose(0, 1)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    # ours: the inputs are intermediate tensors, as the all-to-alls' results are
    xs = [x.detach().to(dtype).requires_grad_() for x in leaves]
    q, k, v = (x * 1 for x in xs)
    args = attention_args(q, causal, None, window, None)
    schedule = ring_schedule(SeqLayout.dense(s, 1), args.mask)
    out = HeadsAttention.apply(q, k, v, None, schedule, args)
    return out, dout, q, (ref, ref_grads), xs


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 4), (6, 3), (10, 5), (8, 2), (4, 1), (8, 1), (1, 1)])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (5, 0))],
                         ids=["causal", "full", "window"])
def test_matches_float64(hq, hkv, causal, window) -> None:
    out, dout, q, (ref, ref_grads), xs = _run(hq, hkv, 8, 8, causal, window, torch.float64)
    out.backward(dout)
    assert_close(out, ref)
    for got, want in zip(xs, ref_grads):
        assert_close(got.grad, want)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
def test_float32_and_mla_head_dims(hq, hkv) -> None:
    out, dout, q, (ref, ref_grads), xs = _run(hq, hkv, 12, 8, True, None, torch.float32)
    out.backward(dout.float())
    assert_close(out, ref.float(), rtol=2e-5, atol=2e-5)
    for got, want in zip(xs, ref_grads):
        assert_close(got.grad, want.float(), rtol=2e-5, atol=2e-5)


def test_dq_is_written_over_the_saved_q() -> None:
    out, dout, q, *_ = _run(8, 4, 8, 8, True, None, torch.float64)
    seen = {}
    q.register_hook(lambda grad: seen.setdefault("dq", grad))
    out.backward(dout)
    assert seen["dq"].untyped_storage().data_ptr() == q.untyped_storage().data_ptr()


def test_second_backward_through_a_retained_graph_fails() -> None:
    out, dout, *_ = _run(8, 4, 8, 8, True, None, torch.float64)
    out.backward(dout, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(dout)
