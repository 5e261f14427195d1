"""Backend selection: automatic by device, explicit by name, never a silent substitute."""

import pytest
import torch

from megatron_longctx import kernels
from megatron_longctx.kernels import BlockArgs, KernelUnsupported, cpu_flash, get_kernel, kernel_for, reference


def test_auto_on_cpu_picks_cpu_flash():
    assert get_kernel(None, "cpu") is cpu_flash
    q = torch.randn(1, 4, 2, 8)
    assert kernel_for(q, q, q, BlockArgs(0.3)) is cpu_flash


def test_auto_falls_back_when_a_backend_refuses(monkeypatch):
    monkeypatch.setattr(cpu_flash, "check", lambda q, k, v, args: "refused for the test")
    q = torch.randn(1, 4, 2, 8)
    assert kernel_for(q, q, q, BlockArgs(0.3)) is reference
    with pytest.raises(KernelUnsupported, match="'cpu_flash'.*refused for the test"):
        kernel_for(q, q, q, BlockArgs(0.3), preferred="cpu_flash")


def test_named_backend_is_returned_when_it_serves():
    q = torch.randn(1, 4, 2, 8)
    assert kernel_for(q, q, q, BlockArgs(0.3), preferred="reference") is reference
    assert get_kernel("cpu_flash", torch.device("cpu")) is cpu_flash


@pytest.mark.parametrize("name", ["sdpa_cuda", "flash_attn"])
def test_explicit_unavailable_backend_raises_with_reason(name):
    backend = kernels.BACKENDS[name]
    q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    reason = backend.check(q, q, q, BlockArgs(0.3))
    assert reason
    with pytest.raises(KernelUnsupported) as err:
        kernel_for(q, q, q, BlockArgs(0.3), preferred=name)
    assert name in str(err.value) and reason in str(err.value)
    with pytest.raises(KernelUnsupported, match=name):
        get_kernel(name, "cpu")


def test_unknown_name_lists_the_names():
    with pytest.raises(ValueError, match="cpu_flash.*flash_attn.*reference.*sdpa_cuda"):
        get_kernel("tri_dao", "cpu")
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="unknown attention kernel 'xformers'"):
        kernel_for(q, q, q, BlockArgs(0.3), preferred="xformers")


def test_auto_order_per_device():
    assert kernels.select.auto_order("cuda") == ("flash_attn", "sdpa_cuda", "reference")
    assert kernels.select.auto_order("cpu") == ("cpu_flash", "reference")
    assert kernels.select.auto_order("meta") == ("reference",)
    assert get_kernel(None, "meta") is reference


def test_float32_on_cuda_is_refused_in_one_line_not_served_by_the_quadratic_reference(monkeypatch):
    """Automatic selection on CUDA never falls back to ``reference``: the error names the dtype flags and the
    backends that serve them.  (A stand-in for a CUDA tensor: selection reads only device and dtype.)"""
    import types

    from megatron_longctx.kernels import flash_attn, sdpa_cuda

    monkeypatch.setattr(flash_attn, "check", lambda q, k, v, args: "flash_attn supports float16 and bfloat16")
    monkeypatch.setattr(sdpa_cuda, "check", lambda q, k, v, args: "sdpa_cuda (flash) supports float16 and bfloat16")
    monkeypatch.setattr(reference, "check", lambda q, k, v, args: None)
    q = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
    with pytest.raises(KernelUnsupported) as err:
        kernel_for(q, q, q, BlockArgs(0.3))
    message = str(err.value)
    assert "\n" not in message and "torch.float32" in message
    assert "--bf16" in message and "--fp16" in message and "flash_attn" in message and "sdpa_cuda" in message
    assert "--longctx-cp-kernel-backend reference" in message
    assert kernel_for(q, q, q, BlockArgs(0.3), preferred="reference") is reference  # asked for: served
    q64 = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float64)
    assert kernel_for(q64, q64, q64, BlockArgs(0.3)) is reference  # the oracle's dtype
