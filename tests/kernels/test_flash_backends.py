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

from . import flash_attn_releases as releases
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


fa2_kernel, fa3_kernel = releases.fa2_kernel, releases.fa3_kernel


@pytest.mark.parametrize("release", sorted(releases.FA2_RELEASES))
@pytest.mark.parametrize("case", FEW, ids=lambda c: c.name)
def test_flash_attn_2_adapter_per_release(release, case):
    check_pieces_kernel(fa2_kernel(release), case)


@pytest.mark.parametrize("case", FEW, ids=lambda c: c.name)
def test_flash_attn_3_adapter(case):
    check_pieces_kernel(fa3_kernel(), case)


def test_flash_attn_2_probe_reads_each_release_signature():
    """The varlen lse layout and the window keywords come from the signatures, not the version number."""
    from packaging.version import Version

    got = {r: flash_attn.fa2_entry_points(i, Version("2.9")) for r, i in releases.FA2_RELEASES.items()}
    assert {r: g.padded_lse for r, g in got.items()} == {"2.5.0": True, "2.6.3": False, "2.7.4": False, "2.8.3": False}
    styles = {r: flash_attn._window_style(g.varlen_backward_params) for r, g in got.items()}
    assert styles == {"2.5.0": "pair", "2.6.3": "pair", "2.7.4": "split", "2.8.3": "split"}
    broken = types.SimpleNamespace(**vars(releases.FA2_RELEASES["2.8.3"]))
    broken.flash_attn_varlen_func = lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: None
    reason = flash_attn.fa2_entry_points(broken, Version("2.8.3"))
    assert isinstance(reason, str) and "flash_attn_varlen_func" in reason and "window_size" in reason


@pytest.mark.parametrize("entry, usable", [("current", True), ("feb_2025_backward", False), ("no_window_forward", False)])
def test_flash_attn_3_interface_gate(monkeypatch, entry, usable):
    module = types.ModuleType("flash_attn_interface")
    module.flash_attn_func, module.flash_attn_varlen_func = releases.fa3_flash_attn_func, releases.fa3_flash_attn_varlen_func
    module._flash_attn_backward = releases.fa3_flash_attn_backward
    if entry == "feb_2025_backward":
        module._flash_attn_backward = releases.fa3_backward_feb_2025
    if entry == "no_window_forward":
        module.flash_attn_varlen_func = lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, \
            softmax_scale=None, causal=False, return_attn_probs=False: None
    monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
    got = flash_attn._fa3.__wrapped__()
    if usable:
        assert got is module
    elif entry == "feb_2025_backward":
        assert isinstance(got, str) and "window_size_left" in got and "is_causal" in got
    else:
        assert isinstance(got, str) and "flash_attn_varlen_func" in got and "window_size" in got


@pytest.mark.parametrize("op, stand_in", [
    (torch.ops.aten._flash_attention_forward, flash_emulation.flash_forward),
    (torch.ops.aten._flash_attention_backward, flash_emulation.flash_backward)], ids=["forward", "backward"])
def test_the_emulated_torch_ops_have_this_torchs_schema(op, stand_in):
    """The CPU stand-ins take exactly the arguments of this torch's flash ops (names, order, keyword-only)."""
    import inspect

    schema = op.default._schema.arguments
    params = list(inspect.signature(stand_in).parameters.values())
    wanted = [a.name for a in schema if a.name not in ("seqused_k", "alibi_slopes", "block_table", "num_splits")]
    assert [p.name for p in params] == wanted
    keyword_only = {a.name for a in schema if a.kwarg_only}
    assert {p.name for p in params if p.kind is p.KEYWORD_ONLY} == keyword_only & set(wanted)
