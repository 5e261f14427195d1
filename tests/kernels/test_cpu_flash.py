"""cpu_flash against the reference backend: out, lse, dq, dk, dv on every case and dtype.

Tolerances: float64 is tight (1e-10).  Lower precisions compare against the float64 reference on the
same (rounded) inputs: float32 at 1e-5 (observed <= 1.3e-6); bfloat16 outputs/gradients are rounded
to bfloat16 (eps 2**-8) so atol 1e-2 + rtol 1.6e-2 (about 4 ulp, observed <= 1.3e-2 on values up
to 6); float16 (eps 2**-11) atol = rtol = 2e-3.  The lse of half-precision inputs is float32, but
the op's half-precision path depends on the CPU's vector unit: atol 1.5e-4 against a measured
<= 5.8e-5 on an AVX2 CPU (AMD EPYC).
"""

import pytest
import torch

from megatron_longctx.kernels import BlockArgs, BlockMask, KernelUnsupported, cpu_flash, merge, reference

from .cases import CASES, make_inputs

TOL = {
    torch.float64: (dict(rtol=1e-10, atol=1e-10), dict(rtol=1e-10, atol=1e-10)),
    torch.float32: (dict(rtol=1e-5, atol=1e-5), dict(rtol=1e-5, atol=1e-5)),
    torch.bfloat16: (dict(rtol=1.6e-2, atol=1e-2), dict(rtol=1e-5, atol=1.5e-4)),
    torch.float16: (dict(rtol=2e-3, atol=2e-3), dict(rtol=1e-5, atol=1.5e-4)),
}


def compare(got, want, tol):
    torch.testing.assert_close(got.to(torch.float64), want.to(torch.float64), **tol)


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cpu_flash_matches_reference(case, dtype):
    q, k, v, dout = make_inputs(case, dtype)
    args = case.args()
    tol, lse_tol = TOL[dtype]
    q64, k64, v64, dout64 = (t.to(torch.float64) for t in (q, k, v, dout))
    want_out, want_lse = reference.forward(q64, k64, v64, args)
    want_grads = reference.backward(dout64, q64, k64, v64, want_out, want_lse, args)

    out, lse = cpu_flash.forward(q, k, v, args)
    assert out.dtype == dtype and out.shape == (case.b, case.s_q, case.h_q, case.d_v)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    compare(out, want_out, tol)
    compare(lse, want_lse, lse_tol)  # -inf rows must match exactly (assert_close checks infinities)

    final_out, final_lse = want_out.to(dtype), want_lse.to(lse.dtype)
    grads = cpu_flash.backward(dout, q, k, v, final_out, final_lse, args)
    for got, want, x in zip(grads, want_grads, (q, k, v)):
        assert got.dtype == dtype and got.shape == x.shape
        compare(got, want, tol)


@pytest.mark.parametrize("case_name", ["causal_diagonal", "window_both", "gqa", "mla_dqk_gt_dv"])
def test_backward_per_block_with_final_out_lse(case_name):
    """Ring attention's use: backward of each key block given the row's merged out/lse sums to the whole."""
    case = next(c for c in CASES if c.name == case_name)
    q, k, v, dout = make_inputs(case, torch.float64)
    args = case.args()
    cuts = [0, 3, 3, 6, case.s_k]  # one empty block on purpose
    blocks = [
        (a, b, BlockArgs(args.softmax_scale, args.mask, args.q_start, args.k_start + a)) for a, b in zip(cuts, cuts[1:])
    ]
    out = lse = None
    for a, b, block_args in blocks:
        part = cpu_flash.forward(q, k[:, a:b], v[:, a:b], block_args)
        out, lse = part if out is None else merge(out, lse, *part)
    want_out, want_lse = reference.forward(q, k, v, args)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)

    dq = torch.zeros_like(q)
    dk_parts, dv_parts = [], []
    for a, b, block_args in blocks:
        g = cpu_flash.backward(dout, q, k[:, a:b], v[:, a:b], out, lse, block_args)
        dq += g[0]
        dk_parts.append(g[1])
        dv_parts.append(g[2])
    want = reference.backward(dout, q, k, v, want_out, want_lse, args)
    for got, w in zip((dq, torch.cat(dk_parts, 1), torch.cat(dv_parts, 1)), want):
        torch.testing.assert_close(got, w, rtol=1e-10, atol=1e-10)


def test_block_that_sees_nothing_costs_no_call_and_gives_minus_inf():
    q, k, v, dout = make_inputs(next(c for c in CASES if c.name == "causal_q_before_k"), torch.float32)
    args = BlockArgs(0.5, BlockMask(causal=True), q_start=0, k_start=16)
    out, lse = cpu_flash.forward(q, k, v, args)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    grads = cpu_flash.backward(dout, q, k, v, out, lse, args)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_empty_blocks_do_not_reach_the_op():
    q = torch.randn(1, 0, 2, 8)
    k = torch.randn(1, 5, 2, 8)
    out, lse = cpu_flash.forward(q, k, k, BlockArgs(0.5, BlockMask(causal=False)))
    assert out.shape == (1, 0, 2, 8) and lse.shape == (1, 2, 0)
    out, lse = cpu_flash.forward(k, q, q, BlockArgs(0.5, BlockMask(causal=False)))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_refuses_other_devices_and_dtypes():
    q = torch.zeros(1, 2, 2, 4, dtype=torch.int32)
    reason = cpu_flash.check(q, q, q, BlockArgs(1.0))
    assert reason is not None and "int32" in reason
    with pytest.raises(KernelUnsupported, match="int32"):
        cpu_flash.forward(q, q, q, BlockArgs(1.0))
    meta = torch.zeros(1, 2, 2, 4, device="meta")
    assert "CPU" in cpu_flash.check(meta, meta, meta, BlockArgs(1.0))


@pytest.mark.parametrize("case_name", ["gqa", "mqa_window"])
def test_gqa_by_expansion_matches_reference(monkeypatch, case_name):
    """The path for a torch whose CPU op wants equal head counts: expand k/v, fold the grads back."""
    monkeypatch.setattr(cpu_flash, "native_gqa", lambda: False)
    case = next(c for c in CASES if c.name == case_name)
    q, k, v, dout = make_inputs(case, torch.float64)
    out, lse = cpu_flash.forward(q, k, v, case.args())
    want_out, want_lse = reference.forward(q, k, v, case.args())
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    got = cpu_flash.backward(dout, q, k, v, out, lse, case.args())
    for g, w in zip(got, reference.backward(dout, q, k, v, want_out, want_lse, case.args())):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_computes_each_visible_pair_once_and_masks_only_narrow_windows(case, monkeypatch):
    """Cost, counted per op call: the pairs an unmasked call scores (all of them, or the top-left causal
    triangle) plus the visible entries of each additive mask add up to the block's visible pairs, in
    forward and in backward; causal and full blocks take no mask at all (only a band narrower than its
    piece is masked)."""
    calls = {"forward": [], "backward": []}

    def pairs(s_q, s_k, causal, mask):
        if mask is not None:
            return int((mask == 0).sum()), mask.numel()
        return (sum(min(i + 1, s_k) for i in range(s_q)) if causal else s_q * s_k), 0

    def forward(q, k, v, scale, causal, mask=None):
        calls["forward"].append(pairs(q.shape[1], k.shape[1], causal, mask))
        return op_forward(q, k, v, scale, causal, mask)

    def backward(dout, q, k, v, out, lse, scale, causal, mask=None):
        calls["backward"].append(pairs(q.shape[1], k.shape[1], causal, mask))
        return op_backward(dout, q, k, v, out, lse, scale, causal, mask)

    cpu_flash.native_gqa()  # its one probe of the op is not the block's cost
    op_forward, op_backward = cpu_flash._op_forward, cpu_flash._op_backward
    monkeypatch.setattr(cpu_flash, "_op_forward", forward)
    monkeypatch.setattr(cpu_flash, "_op_backward", backward)
    q, k, v, dout = make_inputs(case, torch.float32)
    args = case.args()
    out, lse = cpu_flash.forward(q, k, v, args)
    cpu_flash.backward(dout, q, k, v, out, lse, args)
    visible = int(case.mask.dense(case.q_start, case.s_q, case.k_start, case.s_k).sum())
    for direction, counted in calls.items():
        assert sum(p for p, _ in counted) == visible, (direction, counted, visible)
        if case.mask.window == (-1, -1):
            assert all(m == 0 for _, m in counted), (direction, "a causal or full block took a mask", counted)
