"""The CUDA backends' CPU-testable parts: pieces, window arguments, padding, argument building.

The kernels themselves need a GPU.  Here ``sdpa_cuda``'s piece kernel runs on float64 CPU
stand-ins of torch's flash ops that reproduce flash-attn 2's argument rewrites
(:mod:`.flash_emulation`), through the same driver as on a GPU.
"""

import re
import sys
import types

import pytest
import torch

from megatron_longctx.kernels import BlockArgs, BlockMask, KernelUnsupported, driver, flash_attn, reference, sdpa_cuda

from . import flash_emulation
from .cases import CASES, make_inputs

TIGHT = dict(rtol=1e-10, atol=1e-10)


def emulated(windows: bool = True) -> sdpa_cuda.FlashOpPieces:
    return sdpa_cuda.FlashOpPieces(flash_emulation.flash_forward, flash_emulation.flash_backward, windows)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sdpa_cuda_pieces_match_reference(case):
    q, k, v, dout = make_inputs(case, torch.float64)
    args = case.args()
    pieces = driver.flash2_pieces(args, case.s_q, case.s_k)
    out, lse = driver.forward(emulated(), pieces, q, k, v, args)
    want_out, want_lse = reference.forward(q, k, v, args)
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse, **TIGHT)
    grads = driver.backward(emulated(), pieces, dout, q, k, v, want_out, want_lse, args)
    for got, want in zip(grads, reference.backward(dout, q, k, v, want_out, want_lse, args)):
        torch.testing.assert_close(got, want, **TIGHT)


def test_unsplit_blocks_go_wrong_under_flash_attn_2_rewrites():
    """Control: the emulation is strict enough that skipping the row split is caught."""
    case = next(c for c in CASES if c.name == "window_both_tall")
    q, k, v, _ = make_inputs(case, torch.float64)
    args = case.args()
    out, _ = driver.forward(emulated(), driver.pieces_for(args, case.s_q, case.s_k), q, k, v, args)
    assert not torch.allclose(out, reference.forward(q, k, v, args)[0])


def test_without_window_arguments_only_causal_and_unmasked_pieces_run():
    case = next(c for c in CASES if c.name == "causal_diagonal")
    q, k, v, _ = make_inputs(case, torch.float64)
    args = case.args()
    out, _ = driver.forward(emulated(windows=False), driver.flash2_pieces(args, 8, 8), q, k, v, args)
    torch.testing.assert_close(out, reference.forward(q, k, v, args)[0], **TIGHT)
    window = BlockArgs(0.3, BlockMask(causal=True, window=(2, -1)))
    with pytest.raises(KernelUnsupported, match="window"):
        driver.forward(emulated(windows=False), driver.flash2_pieces(window, 8, 8), q, k, v, window)


def test_this_torch_has_window_arguments():
    assert sdpa_cuda.window_args_supported()


@pytest.mark.parametrize("backend", [sdpa_cuda, flash_attn], ids=lambda m: m.name)
def test_cuda_backends_refuse_cpu_tensors_with_a_reason(backend):
    q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    reason = backend.check(q, q, q, BlockArgs(0.3))
    assert isinstance(reason, str) and reason
    with pytest.raises(KernelUnsupported, match=re.escape(reason)):
        backend.forward(q, q, q, BlockArgs(0.3))


def test_flash_attn_absent_says_so():
    if not isinstance(flash_attn._fa2(), str):
        pytest.skip("flash-attn is installed here")
    assert flash_attn.available(torch.device("cuda")) == "flash-attn is not installed"


# Stand-ins with the signatures of flash-attn's Python entry points (flash_attn/flash_attn_interface.py at
# v2.5.0, v2.6.3, v2.8.3; hopper/flash_attn_interface.py since July 2025), computing with the emulation.


def _fa_forward(q, k, v, scale, causal, window):
    out, lse, *_ = flash_emulation.flash_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False,
        scale=scale, window_size_left=window[0], window_size_right=window[1],
    )
    return out, lse


def _fa_backward_into(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, left, right):
    grads = flash_emulation.flash_backward(
        dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.0, causal, None, None,
        scale=scale, window_size_left=left, window_size_right=right,
    )
    for buf, g in zip((dq, dk, dv), grads):
        buf.copy_(g)


def fa2_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
             alibi_slopes=None, deterministic=False, return_attn_probs=False):
    out, lse = _fa_forward(q, k, v, softmax_scale, causal, window_size)
    return (out, lse, None) if return_attn_probs else out


def fa2_backward_v250(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                      alibi_slopes, deterministic, rng_state=None):
    _fa_backward_into(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, *window_size)


def fa2_backward_v263(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
                      softcap, alibi_slopes, deterministic, rng_state=None):
    _fa_backward_into(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, *window_size)


def fa2_backward_v283(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                      window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    _fa_backward_into(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size_left,
                      window_size_right)


FA2_RELEASES = {"2.5.0": fa2_backward_v250, "2.6.3": fa2_backward_v263, "2.8.3": fa2_backward_v283}


def fa3_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
             window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
             sm_margin=0, return_attn_probs=False):
    out, lse = _fa_forward(q, k, v, softmax_scale, causal, window_size)
    return (out, lse) if return_attn_probs else out


def fa3_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q,
                 max_seqlen_k, dq, dk, dv, softmax_scale, is_causal, window_size_left=-1, window_size_right=-1,
                 softcap=0.0, deterministic=False, sm_margin=0):
    _fa_backward_into(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, is_causal, window_size_left,
                      window_size_right)


def fa3_backward_feb_2025(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                          max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
                          sink_token_length=0, softcap=0.0, deterministic=False, sm_margin=0):
    raise AssertionError("must not be called")


def check_pieces_kernel(kernel, case):
    q, k, v, dout = make_inputs(case, torch.float64)
    args = case.args()
    pieces = driver.flash2_pieces(args, case.s_q, case.s_k)
    out, lse = driver.forward(kernel, pieces, q, k, v, args)
    want_out, want_lse = reference.forward(q, k, v, args)
    torch.testing.assert_close(out, want_out, **TIGHT)
    torch.testing.assert_close(lse, want_lse, **TIGHT)
    grads = driver.backward(kernel, pieces, dout, q, k, v, want_out, want_lse, args)
    for got, want in zip(grads, reference.backward(dout, q, k, v, want_out, want_lse, args)):
        torch.testing.assert_close(got, want, **TIGHT)


FEW = [c for c in CASES if c.name in ("causal_diagonal", "window_both_tall", "gqa", "mla_dqk_gt_dv", "single_query")]


@pytest.mark.parametrize("release", sorted(FA2_RELEASES))
@pytest.mark.parametrize("case", FEW, ids=lambda c: c.name)
def test_flash_attn_2_adapter_per_release(release, case):
    from packaging.version import Version

    fa2 = types.SimpleNamespace(version=Version(release), func=fa2_func, backward=FA2_RELEASES[release])
    check_pieces_kernel(flash_attn._FlashAttn2Pieces(fa2), case)


@pytest.mark.parametrize("case", FEW, ids=lambda c: c.name)
def test_flash_attn_3_adapter(case):
    fa3 = types.SimpleNamespace(flash_attn_func=fa3_func, _flash_attn_backward=fa3_backward)
    check_pieces_kernel(flash_attn._FlashAttn3Pieces(fa3), case)


@pytest.mark.parametrize("backward, usable", [(fa3_backward, True), (fa3_backward_feb_2025, False)])
def test_flash_attn_3_interface_gate(monkeypatch, backward, usable):
    module = types.ModuleType("flash_attn_interface")
    module.flash_attn_func, module._flash_attn_backward = fa3_func, backward
    monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
    got = flash_attn._fa3.__wrapped__()
    if usable:
        assert got is module
    else:
        assert isinstance(got, str) and "window_size_left" in got and "is_causal" in got
