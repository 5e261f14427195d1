"""gpu_check section on model-state offload: a Llama-shaped GPTModel trained plain and with its weights
and gradients streamed layer by layer through device slots from pinned host memory
(``--longctx-model-state-offload host``): equal gradients, the device's peak below the plain step's and within
the slots plus what the plain step holds besides its weights, and the share of the copy time hidden behind compute.
Then the same step streamed from files (``disk``): equal gradients, every load after each pass's first served
by the reader thread's read-ahead (its copy into the slot from pinned memory without blocking).
"""

from __future__ import annotations

import gc
import tempfile
import time
from typing import Any

import torch

from gpu_check_common import Budget, BudgetSkip, Sizes, _sync, copy_overlap
from gpu_check_gpt import batch, build_gpt, compare, dtype_for, loss_and_grads, require_megatron, single_rank_megatron

_MARGIN = 64 << 20  # allocator rounding and the cuBLAS workspace


def _units(model) -> list[tuple[str, Any]]:
    layers = [(f"decoder.layers.{i}.", layer) for i, layer in enumerate(model.decoder.layers)]
    return [("embedding.", model.embedding), *layers, ("output_layer.", model.output_layer)]


def _streamed_step(model, streamer, units, tokens, pos, device, accumulate: bool = False) -> dict:
    """One step with the streamer in place: the loss and every parameter's gradient (the streamed ones from
    their off-device accumulators, added to what they held when ``accumulate``), the device's peak and the
    step's seconds."""
    if not accumulate:
        streamer.zero_grad()
        model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    loss = model(tokens, pos, None, labels=torch.roll(tokens, -1, dims=1)).float().mean()
    loss.backward()
    streamer.finish_backward()
    _sync(device)
    seconds = time.perf_counter() - t0
    streamer.check_released()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    for i, (prefix, unit) in enumerate(units):
        for (name, _), g in zip(unit.named_parameters(), streamer.unit_grads(i)):
            if g is not None:
                grads[prefix + name] = g.clone()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"seconds": seconds, "peak_bytes": peak, "result": (loss.detach(), grads)}


def section_model_states(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    require_megatron()
    from megatron_longctx.memory.host_pool import HostPool
    from megatron_longctx.memory.model_states import ModelStateStreamer, StreamOptions

    dtype = dtype_for(device)
    shape, seq = sizes.offload_model, max(sizes.offload_seq // 4, 64)
    out: dict[str, Any] = {"shape": shape, "seq": seq, "dtype": str(dtype), "targets": ["host", "disk"]}
    with single_rank_megatron(device):
        tokens, pos = batch(shape, seq, device)
        model, _ = build_gpt(shape, seq, dtype, {})
        model = model.to(device)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        loss_and_grads(model, tokens, pos)  # warm-up
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        plain = loss_and_grads(model, tokens, pos)
        _sync(device)
        plain_s = time.perf_counter() - t0
        plain_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        plain = (plain[0], {n: g.cpu() for n, g in plain[1].items()})  # off the device the streamed step measures
        del model
        gc.collect()
        if budget.left() <= 0:
            raise BudgetSkip("time budget (the plain step took it all)")

        model, _ = build_gpt(shape, seq, dtype, {})
        model = model.to(device)
        units = _units(model)
        opts = StreamOptions(target="host", device=device, pool=HostPool(64 << 30, pin=device.type == "cuda"),
                             grad_dtype=dtype)
        streamer = ModelStateStreamer([u for _, u in units], opts)
        gc.collect()
        try:
            _streamed_step(model, streamer, units, tokens, pos, device)  # warm-up
            before = streamer.bytes_in + streamer.bytes_out
            run = _streamed_step(model, streamer, units, tokens, pos, device)
            moved = streamer.bytes_in + streamer.bytes_out - before  # over the host link in one step
            # a second micro-batch: the off-device accumulators add it (on the device, then copied out)
            twice = _streamed_step(model, streamer, units, tokens, pos, device, accumulate=True)
        finally:
            streamer.remove()
    if budget.left() <= 0:
        raise BudgetSkip("time budget (before the disk step)")
    with single_rank_megatron(device), tempfile.TemporaryDirectory(prefix="gpu-check-states-") as root:
        model, _ = build_gpt(shape, seq, dtype, {})
        model = model.to(device)
        units = _units(model)
        opts = StreamOptions(target="disk", device=device, pool=HostPool(64 << 30, pin=device.type == "cuda"),
                             disk_dir=root, grad_dtype=dtype)
        disk_streamer = ModelStateStreamer([u for _, u in units], opts)
        try:
            _streamed_step(model, disk_streamer, units, tokens, pos, device)  # warm-up

            def counts() -> tuple:
                return disk_streamer.reads_ahead_used, disk_streamer.prefetches, disk_streamer.loads

            before = counts()
            disk = _streamed_step(model, disk_streamer, units, tokens, pos, device)
            ahead = tuple(b - a for a, b in zip(before, counts()))
        finally:
            disk_streamer.remove()
        del model
        gc.collect()
    disk_cmp = compare(plain, disk["result"])
    out.update(disk_s=disk["seconds"], disk_grad_max_rel_err=disk_cmp["grad_max_rel_err"],
               disk_loss_rel_err=disk_cmp["loss_rel_err"], disk_reads_ahead_used=ahead[0],
               disk_reads_ahead=ahead[1], disk_loads=ahead[2])
    if device.type == "cuda":
        out["disk_peak_gib"] = disk["peak_bytes"] / 2**30
    out.update(compare(plain, run["result"]))
    doubled = compare((plain[0], {n: 2 * g for n, g in plain[1].items()}), twice["result"])
    out["accumulated_grad_max_rel_err"] = doubled["grad_max_rel_err"]
    # the same kernels on the same weights; bf16 backward on a GPU is not bitwise repeatable (atomics)
    tol = 1e-6 if dtype == torch.float32 else 3e-2
    grads_ok = (max(out["grad_max_rel_err"], out["accumulated_grad_max_rel_err"], out["loss_rel_err"],
                    out["disk_grad_max_rel_err"], out["disk_loss_rel_err"]) <= tol
                and not out["grad_keys_differ"] and not doubled["grad_keys_differ"]
                and not disk_cmp["grad_keys_differ"])
    # disk: one load per unit for the forward and one for the backward, all but each pass's first read ahead
    n = len(units)
    grads_ok = grads_ok and ahead == (2 * (n - 1), 2 * (n - 1), 2 * n)
    out.update(plain_s=plain_s, streamed_s=run["seconds"], slots_bytes=streamer.capacity,
               peak_resident_bytes=streamer.peak_resident, weights_bytes=weights, copied_bytes_per_step=moved)
    if device.type == "cuda":
        pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        _sync(device)
        t0 = time.perf_counter()
        dev.copy_(pinned, non_blocking=True)
        _sync(device)
        bandwidth = (1 << 30) / (time.perf_counter() - t0)
        copy_s = moved / bandwidth
        extra = run["seconds"] - plain_s
        # The plain step's peak less its weights is its activations plus the gradients it held at that moment
        # (at most all of them): with the weights streamed, the slots take the weights' place.
        bound = plain_peak - weights + streamer.capacity + _MARGIN
        out.update(plain_peak_gib=plain_peak / 2**30, streamed_peak_gib=run["peak_bytes"] / 2**30,
                   bound_gib=bound / 2**30, host_gbps=bandwidth / 1e9, copy_s_if_serial=copy_s,
                   **copy_overlap(extra, copy_s))
        lowered = run["peak_bytes"] < plain_peak
        out["status"] = "ok" if grads_ok and lowered and run["peak_bytes"] <= bound else "failed"
    else:
        out["status"] = "ok" if grads_ok and moved > 0 else "failed"
        out["note"] = "CPU: the slots are host tensors; no device peak or copy overlap here"
    return out
