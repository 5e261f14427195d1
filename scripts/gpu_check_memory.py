"""gpu_check sections on memory: activation offload wired as ``memory.install`` wires it; the longest
trainable sequence with every memory feature on, after a numerics check of those features.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from typing import Any

import torch

from gpu_check_common import Budget, Sizes, _sync, _time
from gpu_check_gpt import batch, build_gpt, compare, dtype_for, loss_and_grads, require_megatron, single_rank_megatron


def _host_bandwidth(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return nbytes / _time(lambda: dst.copy_(src, non_blocking=True), device)


def _step(model, tokens, pos, device) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    t0 = time.perf_counter()
    result = loss_and_grads(model, tokens, pos)
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return {"seconds": seconds, "peak_bytes": peak, "result": result}


def section_offload(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    """The same GPTModel trained plain and with ``install(model, cfg)`` offloading every layer's saved
    tensors (host on a GPU; disk on the CPU, where host offload lowers nothing).  ``install`` runs before
    the model moves to the device, as under ``--use-cpu-initialization``."""
    require_megatron()
    from megatron_longctx.memory import MemoryConfig, install

    dtype = dtype_for(device)
    shape, seq = sizes.offload_model, sizes.offload_seq
    target = "host" if device.type == "cuda" else "disk"
    cfg = MemoryConfig(offload_policy="layers", offload_target=target, offload_host_pool_bytes=64 << 30,
                       offload_max_inflight=16, offload_min_bytes=(1 << 16) if device.type == "cuda" else 0)
    out: dict[str, Any] = {"shape": shape, "seq": seq, "target": target,
                           "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    with single_rank_megatron(device):
        tokens, pos = batch(shape, seq, device)
        model, _ = build_gpt(shape, seq, dtype, {})
        model = model.to(device)
        _step(model, tokens, pos, device)  # warm-up (allocator, kernels)
        plain = min((_step(model, tokens, pos, device) for _ in range(2)), key=lambda r: r["seconds"])
        del model
        gc.collect()
        model, _ = build_gpt(shape, seq, dtype, {})
        handle = install(model, cfg)  # parameters still on the CPU: they move afterwards
        model = model.to(device)
        try:
            _step(model, tokens, pos, device)
            handle.offloader.synchronize()
            before = handle.offloader.stats.offloaded_bytes
            off = min((_step(model, tokens, pos, device) for _ in range(2)), key=lambda r: r["seconds"])
            handle.offloader.synchronize()
            stats = dataclasses.asdict(handle.offloader.stats)
            per_step = (stats["offloaded_bytes"] - before) / 2
        finally:
            handle.remove()
    out.update(compare(plain["result"], off["result"]))
    out.update(plain_s=plain["seconds"], offload_s=off["seconds"], offloaded_bytes_per_step=per_step,
               offloader=stats)
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the same kernels: only the storage moved
    grads_ok = out["grad_max_rel_err"] <= tol and out["loss_rel_err"] <= tol
    if device.type == "cuda":
        bw = _host_bandwidth(device, 1 << 30)
        copy_s = 2 * per_step / bw  # out and back once per step
        extra = off["seconds"] - plain["seconds"]
        out.update(plain_peak_gib=plain["peak_bytes"] / 2**30, offload_peak_gib=off["peak_bytes"] / 2**30,
                   peak_reduction=1 - off["peak_bytes"] / plain["peak_bytes"], host_gbps=bw / 1e9,
                   copy_s_if_serial=copy_s, hidden_share=1 - max(extra, 0.0) / copy_s if copy_s > 0 else None)
        lowered = off["peak_bytes"] < 0.8 * plain["peak_bytes"]
        out["status"] = "ok" if (lowered and grads_ok and stats["param_refreshes"] >= 1) else "failed"
    else:
        out["status"] = "ok" if grads_ok and per_step > 0 else "failed"
        out["note"] = "CPU: disk target (host offload cannot lower CPU memory); no peak or overlap here"
    return out


# --------------------------------------------------------------------------------------------------
_FEATURES = dict(recompute_granularity="full", offload_policy="checkpoint", tiled_mlp_tiles=8, tiled_loss_tiles=16,
                 cp_algorithm="ring")


def _try_seq(seq: int, device: torch.device, shape: dict, features: dict) -> dict:
    from megatron_longctx.memory import install

    model = handle = None
    try:
        model, lc = build_gpt(shape, seq, dtype_for(device), features)
        model = model.to(device)
        handle = install(model, lc.memory)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tokens, pos = batch(shape, seq, device)
        t0 = time.perf_counter()
        loss = model(tokens, pos, None, labels=tokens)
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


def _numerics(device: torch.device, sizes: Sizes, features: dict) -> dict:
    """Loss and gradients with every feature on against the same model with none (CP attention both)."""
    from megatron_longctx.memory import install

    shape, seq = sizes.stack, sizes.numerics_seq
    tokens, pos = batch(shape, seq, device)
    runs = []
    for feats in ({"cp_algorithm": features.get("cp_algorithm", "ring")}, features):
        model, lc = build_gpt(shape, seq, dtype_for(device), feats)
        model = model.to(device)
        handle = install(model, lc.memory) if lc.memory.any_enabled else None
        runs.append(loss_and_grads(model, tokens, pos))
        if handle is not None:
            handle.remove()
        del model
        gc.collect()
    cmp = compare(runs[0], runs[1])
    return {"seq": seq, **cmp, "tolerance": 3e-2 if device.type == "cuda" else 1e-4}


def section_max_seq(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    require_megatron()
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    features = dict(_FEATURES, offload_host_pool_bytes=host_bytes // 2)
    if device.type == "cpu":
        features["offload_target"] = "disk"
    trials: list[dict] = []
    good, bad = 0, None
    seq, last_s = sizes.seq_start, 0.0
    dropped: dict[str, str] = {}
    with single_rank_megatron(device):
        while True:  # a feature this Megatron's spec cannot take is dropped (and reported), not fatal
            try:
                numerics = _numerics(device, sizes, features)
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
    numerics_ok = (numerics["loss_rel_err"] <= numerics["tolerance"]
                   and numerics["grad_max_rel_err"] <= numerics["tolerance"] and not numerics["grad_keys_differ"])
    return {"shape": sizes.stack, "features": features, "dropped_features": dropped, "numerics": numerics,
            "numerics_rel_err": max(numerics["loss_rel_err"], numerics["grad_max_rel_err"]),
            "max_trained_seq": good, "first_failed_seq": bad, "stopped_by": stopped, "trials": trials,
            "status": "ok" if good > 0 and numerics_ok else "failed"}
