"""The lean RMSNorm: torch's ``nn.RMSNorm`` values and gradients, with only ``x`` and ``1/rms`` saved.

Oracles: ``nn.RMSNorm`` in float64 (the function), and a Megatron GPTModel with RMSNorm run without
the flag (the model at TP=2, plain and under full recompute).
"""

import pytest
import torch

from megatron_longctx.memory import MemoryConfig
from megatron_longctx.memory import rmsnorm as rmsnorm
from megatron_longctx.memory.rmsnorm import install_lean_norms, lean_rms_norm
from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import ORACLE, assert_same, build_gpt, cpu, loss_and_grads


def _inputs(dtype, shape=(5, 3, 16)):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    weight = (1 + torch.randn(shape[-1], generator=g, dtype=torch.float64) / 4).to(dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, weight, dy


def _run(fn, x, weight, dy):
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = fn(x, weight)
    y.backward(dy)
    return y.detach(), x.grad, weight.grad


# atol (rtol 0) for out, dx, dweight: ~3x the largest error measured over both step sizes (out <= 3.2,
# dx <= 1.3, dweight <= 10.1).  float64: 0, 2.2e-16, 8.9e-16; float32: 2.4e-7, 9.1e-8, 8.0e-7; bfloat16
# (the oracle in float64 on the bf16-rounded inputs, so only the output's bf16 rounding and the bf16
# arithmetic count): 1.0e-2, 3.0e-3, 1.5e-2.
ATOL = {torch.float64: (3e-15, 1e-15, 3e-15), torch.float32: (7e-7, 3e-7, 2.4e-6),
        torch.bfloat16: (3e-2, 9e-3, 4.5e-2)}


@pytest.mark.parametrize("rows", [1024, 4], ids=["one-step", "steps-of-4-rows"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["float64", "float32", "bfloat16"])
def test_matches_torch_rms_norm_in_float64(dtype, rows, monkeypatch):
    monkeypatch.setattr(rmsnorm, "BACKWARD_ROWS", rows)  # 15 rows: 4 + 4 + 4 + 3
    x, weight, dy = _inputs(dtype)
    want = _run(lambda x_, w_: torch.nn.functional.rms_norm(x_, (x.shape[-1],), w_, 1e-5),
                x.double(), weight.double(), dy.double())
    got = _run(lambda x_, w_: lean_rms_norm(x_, w_, 1e-5), x, weight, dy)
    for g, w, name, atol in zip(got, want, ("out", "dx", "dweight"), ATOL[dtype]):
        assert g.dtype == dtype, name
        torch.testing.assert_close(g.double(), w, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _saved_bytes(fn, x, weight) -> int:
    """Bytes of the non-parameter tensors autograd saves for ``fn(x, weight)``'s backward."""
    saved = []

    def pack(t):
        if t is not weight and t.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr():
            saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, weight)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(storages.values())


def test_saves_only_input_and_inverse_rms():
    x, weight, _ = _inputs(torch.float32, (64, 2, 32))
    x, weight = x.requires_grad_(), weight.requires_grad_()
    lean = _saved_bytes(lambda a, w: lean_rms_norm(a, w, 1e-5), x, weight)
    plain = _saved_bytes(lambda a, w: torch.nn.functional.rms_norm(a, (32,), w, 1e-5), x, weight)
    rows = 64 * 2
    assert lean == x.nbytes + rows * 4  # x itself (shared storage) and one float32 per row
    assert plain > lean + x.nbytes // 2, (plain, lean)  # torch's composite keeps more on CPU


def _backward_peak_bytes(x, weight, dy) -> int:
    """Peak bytes of the storages the norm's backward creates (its inputs and saved tensors not counted)."""
    from megatron_longctx.bench.live_memory import LiveTensors

    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = lean_rms_norm(x, weight, 1e-5)
    with LiveTensors() as live:
        for t in (dy, *y.grad_fn.saved_tensors):  # views of what exists already are not new memory
            live._ptrs[t.untyped_storage().data_ptr()] = [0, "input", 1 << 30]
        start = live.peak = live.live
        grads = torch.autograd.grad(y, (x, weight), dy)
    assert grads[0].shape == x.shape
    return live.peak - start


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_backward_makes_dx_and_two_float32_buffers_of_one_step(dtype, monkeypatch):
    monkeypatch.setattr(rmsnorm, "BACKWARD_ROWS", 64)
    x, weight, dy = _inputs(dtype, (256, 2, 64))  # 512 rows: 8 steps
    peak = _backward_peak_bytes(x, weight, dy)
    dx = x.numel() * x.element_size()  # [s, b, h] in x's dtype
    step = 64 * 64 * 4  # one [rows, h] float32 buffer
    # dx, xhat and g of one step, the per-row means and the [h] weight gradient: the whole-sequence
    # float32 xhat and g of an unstepped backward would be 16 such buffers
    assert peak <= dx + 2 * step + 64 * 4 + 2 * 64 * 4, (peak, dx, step)
    assert peak >= dx + 2 * step


def _gpt_body():
    from megatron_longctx.megatron.memory_spec import install

    with cpu(), megatron_parallel(tp=2):
        fields = dict(ORACLE, normalization="RMSNorm")
        ref = loss_and_grads(build_gpt(**fields))
        for cfg in (MemoryConfig(lean_norm=True), MemoryConfig(lean_norm=True, recompute_granularity="full")):
            model = build_gpt(**fields)
            norms = [m for m in model.modules() if type(m) is torch.nn.RMSNorm]
            assert len(norms) == 2 * 2 + 1  # two per layer and the final norm
            handle = install(model, cfg)
            assert all("forward" in m.__dict__ for m in norms)
            assert_same(ref, loss_and_grads(model))
            handle.remove()
            assert not any("forward" in m.__dict__ for m in norms)


def test_gpt_with_lean_norm_matches_plain_tp2():
    run_ranks(2, _gpt_body)


def test_other_norms_are_left_alone():
    layer = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.RMSNorm(8))
    removers = install_lean_norms([layer])
    assert len(removers) == 1 and "forward" not in layer[0].__dict__ and "forward" in layer[1].__dict__
    for remove in removers:
        remove()
    assert "forward" not in layer[1].__dict__
