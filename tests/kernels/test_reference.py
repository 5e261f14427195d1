"""The oracle itself: the reference backend against autograd through a naive float64 softmax attention."""

import pytest
import torch

from megatron_longctx.kernels import BlockArgs, BlockMask, check_shapes, reference

from tests.oracle import attention as naive_attention

from .cases import CASES, make_inputs, visible_pairs

TIGHT = dict(rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_matches_autograd(case):
    q, k, v, dout = make_inputs(case, torch.float64)
    args = case.args()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    seen = visible_pairs(case.mask, case.q_start, case.s_q, case.k_start, case.s_k)
    want_out, want_lse = naive_attention(*leaves, args.softmax_scale, seen)
    want_grads = torch.autograd.grad((want_out * dout).sum(), leaves, allow_unused=True)
    want_grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, want_grads)]

    out, lse = reference.forward(q, k, v, args)
    torch.testing.assert_close(out, want_out.detach(), **TIGHT)
    torch.testing.assert_close(lse, want_lse.detach(), **TIGHT)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64 and lse.shape == (case.b, case.h_q, case.s_q)
    for got, want in zip(reference.backward(dout, q, k, v, out, lse, args), want_grads):
        torch.testing.assert_close(got, want, **TIGHT)


def test_rows_that_see_nothing_give_zero_and_minus_inf():
    case = next(c for c in CASES if c.name == "causal_q_overlaps_before")
    q, k, v, dout = make_inputs(case, torch.float64)
    out, lse = reference.forward(q, k, v, case.args())
    dead = slice(0, case.k_start - case.q_start)  # queries before the first key
    assert torch.equal(out[:, dead], torch.zeros_like(out[:, dead]))
    assert torch.isneginf(lse[:, :, dead]).all() and torch.isfinite(lse[:, :, dead.stop :]).all()
    dq, _, _ = reference.backward(dout, q, k, v, out, lse, case.args())
    assert torch.equal(dq[:, dead], torch.zeros_like(dq[:, dead])) and dq[:, dead.stop :].abs().sum() > 0


def test_reference_lse_is_float32_for_low_precision():
    q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    out, lse = reference.forward(q, q, q, BlockArgs(0.3))
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize(
    "shapes, message",
    [
        (((1, 4, 2, 8), (1, 4, 2, 6), (1, 4, 2, 8)), "head dims differ"),
        (((1, 4, 3, 8), (1, 4, 2, 8), (1, 4, 2, 8)), "multiple of key/value heads"),
        (((1, 4, 2, 8), (1, 5, 2, 8), (1, 4, 2, 8)), "must agree on"),
        (((2, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)), "batch sizes differ"),
        (((4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 8)), "must be \\[b, s, h, d\\]"),
    ],
)
def test_check_shapes_names_the_problem(shapes, message):
    q, k, v = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        check_shapes(q, k, v)


def test_check_shapes_rejects_mixed_dtypes():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="share one dtype"):
        check_shapes(q, q.double(), q)


def test_window_must_be_minus_one_or_more():
    with pytest.raises(ValueError, match="window_size"):
        BlockMask(window=(-2, 0))
