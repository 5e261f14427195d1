"""gpu_check sections on memory: activation offload on a layer stack; the longest trainable sequence."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from typing import Any, Callable

import torch

from gpu_check_common import Budget, Sizes, Skip, _rel_err, _sync, _time


class _Stack(torch.nn.Module):
    """Pre-norm MLP blocks: a plain torch stand-in for transformer layers."""

    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
            torch.nn.Linear(4 * hidden, hidden)) for _ in range(layers))

    def forward(self, x: torch.Tensor, scope: Callable[[int], Any] = lambda i: contextlib.nullcontext()):
        for i, block in enumerate(self.blocks):
            with scope(i):
                x = x + block(x)
        return x


def _train_step(model: _Stack, x: torch.Tensor, device: torch.device, offloader=None) -> dict:
    from megatron_longctx.memory import hooks

    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    t0 = time.perf_counter()
    if offloader is None:
        loss = model(x).float().square().mean()
    else:
        offloader.next_microbatch()
        with hooks.packing(offloader):
            loss = model(x, scope=hooks.layer_scope).float().square().mean()
    loss.backward()
    _sync(device)
    elapsed = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else None
    return {"seconds": elapsed, "peak_bytes": peak, "grads": [p.grad.detach().clone() for p in model.parameters()]}


def _host_bandwidth(device: torch.device, nbytes: int) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    seconds = _time(lambda: dst.copy_(src, non_blocking=True), device)
    return nbytes / seconds


def section_offload(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    from megatron_longctx.memory.config import MemoryConfig
    from megatron_longctx.memory.offload import ActivationOffloader

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = _Stack(sizes.offload_layers, sizes.offload_hidden).to(device=device, dtype=dtype)
    x = torch.randn(sizes.offload_tokens, sizes.offload_hidden, device=device, dtype=dtype, requires_grad=True)
    cfg = MemoryConfig(offload_policy="layers", offload_target="host", offload_host_pool_bytes=64 << 30)
    offloader = ActivationOffloader(cfg, params=tuple(model.parameters()), num_layers=sizes.offload_layers)
    try:
        _train_step(model, x, device)  # warm-up (allocator, kernels)
        plain = min((_train_step(model, x, device) for _ in range(2)), key=lambda r: r["seconds"])
        _train_step(model, x, device, offloader)
        off = min((_train_step(model, x, device, offloader) for _ in range(2)), key=lambda r: r["seconds"])
        stats = dataclasses.asdict(offloader.stats)
    finally:
        with contextlib.suppress(Exception):
            offloader.close()
    grad_err = max(_rel_err(a, b) for a, b in zip(off["grads"], plain["grads"]))
    result: dict[str, Any] = {"layers": sizes.offload_layers, "tokens": sizes.offload_tokens,
                              "hidden": sizes.offload_hidden, "plain_s": plain["seconds"],
                              "offload_s": off["seconds"], "grad_max_rel_err": grad_err, "offloader": stats}
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-6
    if device.type == "cuda":
        bw = _host_bandwidth(device, 1 << 30)
        copy_s = 2 * stats["offloaded_bytes"] / 3 / bw  # three runs counted; out and back once per run
        extra = off["seconds"] - plain["seconds"]
        result.update(plain_peak_gib=plain["peak_bytes"] / 2**30, offload_peak_gib=off["peak_bytes"] / 2**30,
                      peak_reduction=1 - off["peak_bytes"] / plain["peak_bytes"], host_gbps=bw / 1e9,
                      copy_s_if_serial=copy_s, hidden_share=1 - max(extra, 0.0) / copy_s if copy_s > 0 else None)
        lowered = off["peak_bytes"] < 0.8 * plain["peak_bytes"]
        result["status"] = "ok" if (lowered and grad_err <= tol) else "failed"
    else:
        result["status"] = "ok" if grad_err <= tol else "failed"
        result["note"] = "CPU: host offload cannot lower memory here (the offloader counts host_noop_bytes)"
    return result


# --------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _single_rank_megatron(device: torch.device):
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_longctx import cpu_compat

    created = False
    if not dist.is_initialized():
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=1)
        created = True
    try:
        with cpu_compat.enabled():
            parallel_state.initialize_model_parallel(1, 1)
            try:
                yield
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        if created:
            dist.destroy_process_group()


def _try_seq(seq: int, device: torch.device, shape: dict, features: dict) -> dict:
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_longctx.config import LongContextConfig
    from megatron_longctx.megatron.spec import apply_to_spec
    from megatron_longctx.memory import install

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = handle = None
    try:
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        cfg = TransformerConfig(
            num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
            num_attention_heads=shape["num_attention_heads"], num_query_groups=shape["num_query_groups"],
            kv_channels=shape["kv_channels"], ffn_hidden_size=shape["ffn_hidden_size"], normalization="RMSNorm",
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
            attention_dropout=0.0, bf16=dtype == torch.bfloat16, params_dtype=dtype,
            use_cpu_initialization=device.type == "cpu",
        )
        lc = LongContextConfig.from_flat(features)
        spec = apply_to_spec(get_gpt_layer_local_spec(), config=lc)
        model = GPTModel(cfg, spec, vocab_size=shape["vocab_size"], max_sequence_length=seq,
                         position_embedding_type="rope", rotary_base=500000).to(device)
        handle = install(model, lc.memory)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tokens = torch.randint(0, shape["vocab_size"], (1, seq), device=device)
        position_ids = torch.arange(seq, device=device).unsqueeze(0)
        t0 = time.perf_counter()
        loss = model(tokens, position_ids, None, labels=tokens)
        loss.float().mean().backward()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        return {"seq": seq, "ok": True, "seconds": time.perf_counter() - t0, "peak_gib": peak}
    except torch.OutOfMemoryError as exc:
        return {"seq": seq, "ok": False, "oom": True, "error": str(exc).splitlines()[0]}
    except RuntimeError as exc:  # pinned host memory or a CUDA allocation refused outside the caching allocator
        if "out of memory" not in str(exc).lower() and "pin" not in str(exc).lower():
            raise
        return {"seq": seq, "ok": False, "oom": True, "error": str(exc).splitlines()[0]}
    finally:
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.remove()
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def section_max_seq(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    try:
        import megatron.core  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"megatron-core is not importable ({type(exc).__name__}: {exc}); carry its wheel to run this")
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    features = dict(recompute_granularity="full", offload_policy="checkpoint", offload_host_pool_bytes=host_bytes // 2,
                    tiled_mlp_tiles=8, tiled_loss_tiles=16, cp_algorithm="ring")
    trials: list[dict] = []
    good, bad = 0, None
    seq, last_s = sizes.seq_start, 0.0
    dropped: dict[str, str] = {}
    with _single_rank_megatron(device):
        while True:  # a feature this Megatron's spec cannot take is dropped (and reported), not fatal
            try:
                trials.append(_try_seq(sizes.seq_start // 4, device, sizes.stack, features))
                break
            except ValueError as exc:
                name = next((f for f in features if "--longctx-" + f.replace("_", "-") in str(exc)), None)
                if name is None or name in dropped:
                    raise
                dropped[name] = str(exc).splitlines()[0][:300]
                features.pop(name)
        while bad is None and seq <= sizes.seq_cap:  # grow by doubling
            if last_s and budget.left() < last_s * 4.5:  # attention time grows with s²
                break
            trial = _try_seq(seq, device, sizes.stack, features)
            trials.append(trial)
            if trial["ok"]:
                good, last_s, seq = seq, trial["seconds"], seq * 2
            else:
                bad = seq
        while bad is not None and bad - good > sizes.seq_granularity:  # then bisect
            mid = (good + bad) // 2 // sizes.seq_granularity * sizes.seq_granularity
            if mid <= good or budget.left() < last_s * 2.5:
                break
            trial = _try_seq(mid, device, sizes.stack, features)
            trials.append(trial)
            if trial["ok"]:
                good, last_s = mid, trial["seconds"]
            else:
                bad = mid
    stopped = "oom bracket resolved" if bad is not None else ("cap" if seq > sizes.seq_cap else "time budget")
    return {"shape": sizes.stack, "features": features, "dropped_features": dropped, "max_trained_seq": good, "first_failed_seq": bad,
            "stopped_by": stopped, "trials": trials, "status": "ok" if good > 0 else "failed"}
