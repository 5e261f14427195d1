"""gpu_check pieces on Megatron's GPTModel: a one-rank Megatron, model building, and the ``gpt_step``
section (one training step with ContextParallelAttention at CP=1 against Megatron's own attention).

Megatron-Core may be absent on the device image; these sections then skip with the reason (carry the
wheel: see scripts/gpu_check.sh).
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any, Optional

import torch

from gpu_check_common import Budget, Sizes, Skip, _rel_err, _sync, worst


def require_megatron() -> None:
    try:
        import megatron.core  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"megatron-core is not importable ({type(exc).__name__}: {exc}); carry its wheel to run this")


@contextlib.contextmanager
def single_rank_megatron(device: torch.device):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_longctx.megatron import cpu_compat

    created = False
    if not dist.is_initialized():
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
        created = True
    try:
        with cpu_compat.enabled() if device.type == "cpu" else contextlib.nullcontext():
            parallel_state.initialize_model_parallel(1, 1)
            try:
                yield
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        if created:
            dist.destroy_process_group()


def dtype_for(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_gpt(shape: dict, seq: int, dtype: torch.dtype, features: Optional[dict] = None, seed: int = 0):
    """A Llama-style GPTModel built on the CPU (``--use-cpu-initialization``: the same weights whatever the
    spec) with Megatron's local spec, or this plugin's spec when ``features`` is given (``--longctx-*`` fields)."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"], num_query_groups=shape["num_query_groups"],
        kv_channels=shape["kv_channels"], ffn_hidden_size=shape["ffn_hidden_size"], normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype, use_cpu_initialization=True,
    )
    spec = get_gpt_layer_local_spec()
    lc = None
    if features is not None:
        from megatron_longctx.config import LongContextConfig
        from megatron_longctx.megatron.spec import apply_to_spec

        lc = LongContextConfig.from_flat(features)
        spec = apply_to_spec(spec, config=lc)
    model = GPTModel(cfg, spec, vocab_size=shape["vocab_size"], max_sequence_length=seq,
                     position_embedding_type="rope", rotary_base=500000)
    return model, lc


def batch(shape: dict, seq: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, shape["vocab_size"], (1, seq), generator=g).to(device)
    return tokens, torch.arange(seq, device=device).unsqueeze(0)


def loss_and_grads(model, tokens, position_ids) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens, position_ids, None, labels=torch.roll(tokens, -1, dims=1)).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(ref: tuple, got: tuple) -> dict:
    (l_ref, g_ref), (l_got, g_got) = ref, got
    missing = sorted(set(g_ref) ^ set(g_got))
    return {"loss_ref": l_ref.item(), "loss": l_got.item(), "loss_rel_err": _rel_err(l_got, l_ref),
            "grad_max_rel_err": worst(_rel_err(g_got[n], g) for n, g in g_ref.items() if n in g_got),
            "grad_keys_differ": missing}


def section_gpt_step(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    """One step (forward, backward, SGD update, forward again) of a tiny GPTModel whose core attention is
    ContextParallelAttention at CP=1, against the same model with Megatron's own DotProductAttention."""
    require_megatron()
    dtype = dtype_for(device)
    shape, seq = sizes.gpt_model, sizes.gpt_seq
    results: dict[str, Any] = {"shape": shape, "seq": seq, "dtype": str(dtype)}
    with single_rank_megatron(device):
        tokens, pos = batch(shape, seq, device)
        runs = {}
        for name, features in (("megatron", None), ("longctx", {})):
            model, _ = build_gpt(shape, seq, dtype, features)
            model = model.to(device)
            first = loss_and_grads(model, tokens, pos)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.grad, alpha=-1e-2)  # the SGD step, the same on both
            second = loss_and_grads(model, tokens, pos)
            _sync(device)
            runs[name] = (first, second)
            used = {type(m).__name__ for m in model.modules()}
            results[f"{name}_core_attention"] = sorted(u for u in used if "Attention" in u and u != "SelfAttention")
            del model
    results["step1"] = compare(runs["megatron"][0], runs["longctx"][0])
    results["step2"] = compare(runs["megatron"][1], runs["longctx"][1])
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    ok = all(results[s]["loss_rel_err"] <= tol and results[s]["grad_max_rel_err"] <= tol
             and not results[s]["grad_keys_differ"] for s in ("step1", "step2"))
    ok &= "ContextParallelAttention" in results["longctx_core_attention"]
    results["tolerance"] = tol
    results["status"] = "ok" if ok else "failed"
    return results
