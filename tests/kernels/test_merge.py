"""The online-softmax merge: partials over disjoint key sets fold into attention over their union."""

import pytest
import torch

from megatron_longctx.kernels import BlockArgs, BlockMask, cpu_flash, merge, merge_, reference

from .cases import CASES, make_inputs

TIGHT = dict(rtol=1e-10, atol=1e-10)


def partials(backend, q, k, v, args, cuts):
    for a, b in zip(cuts, cuts[1:]):
        block_args = BlockArgs(args.softmax_scale, args.mask, args.q_start, args.k_start + a)
        yield backend.forward(q, k[:, a:b], v[:, a:b], block_args)


@pytest.mark.parametrize("backend", [reference, cpu_flash], ids=lambda m: m.name)
@pytest.mark.parametrize("case_name", ["dense", "causal_diagonal", "window_both", "gqa", "mla_dqk_lt_dv"])
def test_two_halves_merge_to_the_whole(backend, case_name):
    case = next(c for c in CASES if c.name == case_name)
    q, k, v, _ = make_inputs(case, torch.float64)
    args = case.args()
    (out_a, lse_a), (out_b, lse_b) = partials(backend, q, k, v, args, [0, case.s_k // 2, case.s_k])
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = reference.forward(q, k, v, args)
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse, **TIGHT)


@pytest.mark.parametrize(
    "cuts", [[0, 1, 6, 8], [0, 0, 8], [0, 8, 8], [0, 3, 3, 3, 8], [0, 1, 2, 3, 4, 5, 6, 7, 8]], ids=str
)
def test_uneven_and_empty_partitions(cuts):
    case = next(c for c in CASES if c.name == "causal_q_overlaps_after")
    q, k, v, _ = make_inputs(case, torch.float64)
    args = case.args()
    out = lse = None
    for part in partials(reference, q, k, v, args, cuts):
        out, lse = part if out is None else merge(out, lse, *part)
    want_out, want_lse = reference.forward(q, k, v, args)
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse, **TIGHT)


def test_partials_with_minus_inf_rows():
    """Causal keys split so that early rows see nothing in the second partial, some rows nothing at all."""
    case = next(c for c in CASES if c.name == "causal_q_overlaps_before")  # rows 0-3 see no key
    q, k, v, _ = make_inputs(case, torch.float64)
    args = case.args()
    (out_a, lse_a), (out_b, lse_b) = partials(reference, q, k, v, args, [0, 2, case.s_k])
    assert torch.isneginf(lse_b[:, :, :6]).all() and torch.isneginf(lse_a[:, :, :4]).all()
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = reference.forward(q, k, v, args)
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse, **TIGHT)
    assert torch.isneginf(lse[:, :, :4]).all() and torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    assert not out.isnan().any()


def test_merge_of_bfloat16_partials_is_float32():
    """bf16 partials over keys 0-2 and 3-7 merge, in float32, to attention over all 8 keys (float64 on the
    same bf16 inputs).  Measured: out 2.7e-3 (the partials' bf16 rounding; |out| <= 1.7), lse 1.8e-7."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 2, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    args = BlockArgs(0.3, BlockMask(causal=False))
    (out_a, lse_a), (out_b, lse_b) = partials(reference, q, k, v, args, [0, 3, 8])
    out, lse = merge(out_a, lse_a, out_b, lse_b)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    want_out, want_lse = reference.forward(q.double(), k.double(), v.double(), args)
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=8e-3)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=6e-7)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_in_place_merge_matches_merge(dtype):
    """merge_ folds a partial into accumulator views in place, as merge would, rows that saw nothing included."""
    case = next(c for c in CASES if c.name == "causal_q_overlaps_before")  # rows 0-3 see no key
    q, k, v, _ = make_inputs(case, dtype)
    args = case.args()
    (out_a, lse_a), (out_b, lse_b) = partials(reference, q, k, v, args, [0, 2, case.s_k])
    want_out, want_lse = merge(out_a, lse_a, out_b, lse_b)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out_acc = torch.zeros(out_a.shape[0], out_a.shape[1] + 2, *out_a.shape[2:], dtype=acc)
    lse_acc = torch.full((lse_a.shape[0], lse_a.shape[1], lse_a.shape[2] + 2), float("-inf"), dtype=acc)
    rows = slice(1, 1 + out_a.shape[1])  # views into bigger accumulators
    merge_(out_acc[:, rows], lse_acc[:, :, rows], out_a, lse_a)
    merge_(out_acc[:, rows], lse_acc[:, :, rows], out_b, lse_b)
    tol = TIGHT if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-6)  # float32 sums in another order
    torch.testing.assert_close(out_acc[:, rows], want_out, **tol)
    torch.testing.assert_close(lse_acc[:, :, rows], want_lse, **tol)
    assert not out_acc.isnan().any() and torch.isneginf(lse_acc[:, :, [0, -1]]).all()
