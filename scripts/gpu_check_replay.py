"""gpu_check sections on what only a GPU shows of the tiled replay (``--longctx-recompute-tiles``):

* ``fused_replay`` — one layer under Megatron's DDP (float32 ``main_grad``) with
  ``gradient_accumulation_fusion`` on (apex's kernel, or a torch stand-in with its contract when apex is
  absent): every ``main_grad`` after the tiled replay against plain full recompute under the same DDP;
  a fused linear's placeholder gradient added into ``main_grad`` shows as garbage or NaN there;
* ``residual_grad`` — the residual-gradient offload (``--longctx-offload-residual-grad``) against the
  same tiled replay without it: gradients, the rows it moved, the step's peak, and how much of the
  copy time hid behind compute (``1 - extra step time / copy time at the host link's rate``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch

from gpu_check_common import Budget, Sizes, Skip, _rel_err, copy_overlap
from gpu_check_gpt import batch, build_gpt, compare, dtype_for, require_megatron, single_rank_megatron
from gpu_check_memory import _MEMORY_TILES, _host_bandwidth, _replay_run

_FUSED_TILES = 4


class _TorchWgrad:
    """``fused_weight_gradient_mlp_cuda``'s contract in torch: ``main_grad += grad_output^T @ input``."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        x = total_input.reshape(-1, total_input.shape[-1])  # [tokens, in]
        g = grad_output.reshape(-1, grad_output.shape[-1])  # [tokens, out]
        main_grad.addmm_(g.t().to(main_grad.dtype), x.to(main_grad.dtype))  # [out, in]

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


@contextlib.contextmanager
def _fusion_kernel() -> Iterator[str]:
    """Megatron's fused weight-gradient kernel: apex's when importable, else :class:`_TorchWgrad`."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        yield "apex fused_weight_gradient_mlp_cuda"
        return
    had = hasattr(layers, "fused_weight_gradient_mlp_cuda")
    previous = getattr(layers, "fused_weight_gradient_mlp_cuda", None)
    layers.fused_weight_gradient_mlp_cuda = _TorchWgrad
    try:
        yield "torch stand-in (apex absent)"
    finally:
        if had:
            layers.fused_weight_gradient_mlp_cuda = previous
        else:
            del layers.fused_weight_gradient_mlp_cuda


def _ddp_main_grads(shape: dict, seq: int, dtype: torch.dtype, device: torch.device, cfg: Any, tokens, pos) -> dict:
    """One forward and backward of a GPTModel (all-gather core attention) under ``cfg``, wrapped in
    Megatron's DDP with every linear's gradient accumulation fused: the loss and each ``main_grad``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_longctx.megatron.memory_spec import install

    model, _ = build_gpt(shape, seq, dtype, {"cp_algorithm": "allgather"})
    handle = install(model, cfg)
    model = model.to(device)
    fused = 0
    for module in model.modules():
        if hasattr(module, "gradient_accumulation_fusion"):
            module.gradient_accumulation_fusion = True
            fused += 1
    try:
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        ddp.zero_grad_buffer()
        loss = ddp(tokens, pos, None, labels=torch.roll(tokens, -1, dims=1)).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        flagged = sum(bool(getattr(p, "grad_added_to_main_grad", False)) for p in model.parameters())
    finally:
        handle.remove()
    return {"result": (loss.detach(), grads), "fused_linears": fused, "flagged_params": flagged}


def section_fused_replay(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    """One layer, bf16 (float32 on the CPU) with float32 ``main_grad``: the tiled replay against plain full
    recompute, both under Megatron's DDP with ``gradient_accumulation_fusion``."""
    require_megatron()
    from megatron_longctx.memory import MemoryConfig

    shape, seq, dtype = dict(sizes.gpt_model, num_layers=1), sizes.gpt_seq, dtype_for(device)
    out: dict[str, Any] = {"shape": shape, "seq": seq, "dtype": str(dtype), "tiles": _FUSED_TILES}
    with single_rank_megatron(device), _fusion_kernel() as kernel:
        tokens, pos = batch(shape, seq, device)
        full = _ddp_main_grads(shape, seq, dtype, device, MemoryConfig(recompute_granularity="full"), tokens, pos)
        tiled = _ddp_main_grads(shape, seq, dtype, device,
                                MemoryConfig(recompute_granularity="full", recompute_tiles=_FUSED_TILES), tokens, pos)
    out.update(compare(full["result"], tiled["result"]), kernel=kernel, fused_linears=tiled["fused_linears"],
               flagged_params=tiled["flagged_params"])
    finite = all(torch.isfinite(g).all().item() for g in tiled["result"][1].values())
    out["per_param_rel_err"] = {n: _rel_err(tiled["result"][1][n], g) for n, g in full["result"][1].items()}
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4  # the replay only reorders the sums
    out["tolerance"] = tol
    ok = (finite and out["grad_max_rel_err"] <= tol and out["loss_rel_err"] <= tol and not out["grad_keys_differ"]
          and tiled["fused_linears"] > 0 and tiled["flagged_params"] > 0)
    out["status"] = "ok" if ok else "failed"
    return out


def section_residual_grad(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    """The tiled replay with the checkpoint offload, with and without the residual gradient streamed
    through the host pool on the offloader's side stream (disk on the CPU, where host memory is the
    device's): gradients, bytes streamed, step time and peak, and the share of the copy time hidden."""
    require_megatron()
    from megatron_longctx.memory import MemoryConfig, residual_offload

    shape, seq, dtype = sizes.tiled_model, sizes.tiled_memory_seq, dtype_for(device)
    base = dict(recompute_granularity="full", recompute_tiles=_MEMORY_TILES, offload_policy="checkpoint",
                offload_target="host" if device.type == "cuda" else "disk",
                offload_min_bytes=(1 << 16) if device.type == "cuda" else 0)
    handed = []
    original = residual_offload.hand_over
    out: dict[str, Any] = {"shape": shape, "seq": seq, "dtype": str(dtype), "tiles": _MEMORY_TILES,
                           "target": base["offload_target"]}
    runs = {}
    with single_rank_megatron(device):
        tokens, pos = batch(shape, seq, device)
        residual_offload.hand_over = lambda consumer, stream: handed.append(1) or original(consumer, stream)
        try:
            for name, extra in (("dense", {}), ("streamed", {"offload_residual_grad": True})):
                if runs and budget.left() < 1.5 * runs["dense"]["wall_s"]:
                    raise Skip("time budget (the streamed run would not finish)")
                handed.clear()
                t0 = time.monotonic()
                runs[name] = _replay_run(shape, seq, dtype, device, MemoryConfig(**base, **extra), tokens, pos,
                                         warmup=1 if device.type == "cuda" else 0)
                runs[name].update(wall_s=time.monotonic() - t0, handed=len(handed))
        finally:
            residual_offload.hand_over = original
    dense, streamed = runs["dense"], runs["streamed"]
    moved = streamed["offloader"]["residual_grad_bytes"] / streamed["steps"]
    out.update(compare(dense["result"], streamed["result"]), dense_s=dense["seconds"], streamed_s=streamed["seconds"],
               streams_handed_per_step=streamed["handed"] // streamed["steps"], streamed_bytes_per_step=moved)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    problems = []
    if not (out["grad_max_rel_err"] <= tol and out["loss_rel_err"] <= tol and not out["grad_keys_differ"]):
        problems.append(f"gradients differ from the dense run beyond {tol}")
    if not streamed["handed"]:
        problems.append("no residual gradient was streamed")
    if device.type == "cuda":
        bw = _host_bandwidth(device, 1 << 28)
        copy_s = moved / bw
        extra_s = streamed["seconds"] - dense["seconds"]
        out.update(host_gbps=bw / 1e9, copy_s_if_serial=copy_s, extra_s=extra_s,
                   **copy_overlap(extra_s, copy_s),
                   dense_step_peak_gib=(dense["peak_bytes"] - dense["start_bytes"]) / 2**30,
                   streamed_step_peak_gib=(streamed["peak_bytes"] - streamed["start_bytes"]) / 2**30)
        if not moved > 0:
            problems.append("the streamed run moved no rows through the offloader's side stream")
    else:
        out["note"] = "CPU: disk target; no overlap or peak here"
    out["problems"] = problems
    out["status"] = "ok" if not problems else "failed"
    return out
