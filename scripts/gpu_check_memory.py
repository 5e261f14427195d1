"""gpu_check sections on memory: activation offload wired as ``memory_spec.install`` wires it; full recompute
replayed in sequence tiles, alone and with its layer inputs offloaded and read back one tile at a time;
the longest trainable sequence with every memory feature on, after a numerics check of those features.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from typing import Any

import torch

from gpu_check_common import Budget, Sizes, _sync, _time, copy_overlap
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
    from megatron_longctx.megatron.memory_spec import install
    from megatron_longctx.memory import MemoryConfig

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
                   copy_s_if_serial=copy_s, **copy_overlap(extra, copy_s))
        lowered = off["peak_bytes"] < 0.8 * plain["peak_bytes"]
        out["status"] = "ok" if (lowered and grads_ok and stats["param_refreshes"] >= 1) else "failed"
    else:
        out["status"] = "ok" if grads_ok and per_step > 0 else "failed"
        out["note"] = "CPU: disk target (host offload cannot lower CPU memory); no peak or overlap here"
    return out


# --------------------------------------------------------------------------------------------------
_FEATURES = dict(recompute_granularity="full", offload_policy="checkpoint", tiled_mlp_tiles=8, tiled_loss_tiles=16,
                 cp_algorithm="ring")


class _OutOfTime(Exception):
    """A trial passed the section's deadline (checked at every layer's forward and before backward)."""


def _try_seq(seq: int, device: torch.device, shape: dict, features: dict, deadline: float = float("inf")) -> dict:
    from megatron_longctx.megatron.memory_spec import install

    def in_time(*_: Any) -> None:
        if time.monotonic() > deadline:
            raise _OutOfTime()

    model = handle = None
    try:
        model, lc = build_gpt(shape, seq, dtype_for(device), features)
        model = model.to(device)
        handle = install(model, lc.memory)
        for layer in model.modules():
            if type(layer).__name__ == "TransformerLayer":
                layer.register_forward_pre_hook(in_time)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        tokens, pos = batch(shape, seq, device)
        t0 = time.perf_counter()
        loss = model(tokens, pos, None, labels=tokens)
        _sync(device)
        if time.monotonic() + 2 * (time.perf_counter() - t0) > deadline:  # backward: about two forwards
            raise _OutOfTime()
        loss.float().mean().backward()
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        return {"seq": seq, "ok": True, "seconds": time.perf_counter() - t0, "peak_gib": peak}
    except _OutOfTime:
        return {"seq": seq, "ok": False, "out_of_time": True}
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
    from megatron_longctx.megatron.memory_spec import install

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
    deadline = time.monotonic() + budget.left()
    out_of_time = False
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
            trial = _try_seq(seq, device, sizes.stack, features, deadline)
            trials.append(trial)
            out_of_time = trial.get("out_of_time", False)
            if out_of_time:
                break
            if trial["ok"]:
                good, last_s, seq = seq, trial["seconds"], seq * 2
            else:
                bad = seq
        while bad is not None and bad - good > sizes.seq_granularity:  # then bisect
            mid = (good + bad) // 2 // sizes.seq_granularity * sizes.seq_granularity
            if mid <= good or budget.left() < last_s * 2.5:
                break
            trial = _try_seq(mid, device, sizes.stack, features, deadline)
            trials.append(trial)
            if trial.get("out_of_time"):
                out_of_time = True
                break
            if trial["ok"]:
                good, last_s = mid, trial["seconds"]
            else:
                bad = mid
    stopped = ("time budget (inside a trial)" if out_of_time else "oom bracket resolved" if bad is not None
               else "cap" if seq > sizes.seq_cap else "time budget")
    numerics_ok = (numerics["loss_rel_err"] <= numerics["tolerance"]
                   and numerics["grad_max_rel_err"] <= numerics["tolerance"] and not numerics["grad_keys_differ"])
    return {"shape": sizes.stack, "features": features, "dropped_features": dropped, "numerics": numerics,
            "numerics_rel_err": max(numerics["loss_rel_err"], numerics["grad_max_rel_err"]),
            "max_trained_seq": good, "first_failed_seq": bad, "stopped_by": stopped, "trials": trials,
            "status": "ok" if good > 0 and numerics_ok else "failed"}


# --------------------------------------------------------------------------------------------------
# tiled_replay: full recompute replayed in sequence tiles (--longctx-recompute-tiles).
_NUMERICS_TILES = 5  # tiles of unequal length
_MEMORY_TILES = 8
_F32_RTOL, _F32_ATOL = 1e-4, 1e-5  # atol: times the largest |value| of the reference tensor


def _replay_configs(device: torch.device, tiles: int) -> dict:
    """Plain full recompute, its replay in ``tiles`` sequence tiles, and the replay with the layer inputs
    offloaded by the checkpoint offload (host on a GPU; disk on the CPU, where host offload lowers nothing)."""
    from megatron_longctx.memory import MemoryConfig

    offload = dict(offload_policy="checkpoint", offload_target="host" if device.type == "cuda" else "disk",
                   offload_min_bytes=(1 << 16) if device.type == "cuda" else 0)
    return {"full": MemoryConfig(recompute_granularity="full"),
            "tiled": MemoryConfig(recompute_granularity="full", recompute_tiles=tiles),
            "tiled_offload": MemoryConfig(recompute_granularity="full", recompute_tiles=tiles, **offload)}


class _AttentionCalls:
    """Forward pre-hooks on the plugin's core attentions: the replay pass of every call and its query rows."""

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron_longctx.megatron.core_attention import ContextParallelAttention

        self.modes: set = set()
        self.max_rows = 0
        mods = [m for m in model.modules() if isinstance(m, ContextParallelAttention)]
        self.modules = len(mods)
        self._handles = [m.register_forward_pre_hook(self._seen, with_kwargs=True) for m in mods]

    def _seen(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        replay = module.replay_port.replay
        self.modes.add("whole" if replay is None else replay.mode.value)
        query = args[0] if args else kwargs["query"]  # [s, b, np, hn]
        self.max_rows = max(self.max_rows, query.shape[0])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _peak_step(model, tokens, pos, device: torch.device) -> dict:
    """One forward and backward: seconds, the peak allocated during it (``max_memory_allocated`` after a
    reset) and what was allocated when it began, then the loss and gradients (copied after the peak is read)."""
    model.zero_grad(set_to_none=True)
    labels = torch.roll(tokens, -1, dims=1)
    start = peak = None
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    loss = model(tokens, pos, None, labels=labels).float().mean()
    loss.backward()
    _sync(device)
    seconds = time.perf_counter() - t0
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return {"seconds": seconds, "peak_bytes": peak, "start_bytes": start, "result": (loss.detach(), grads)}


def _replay_run(shape: dict, seq: int, dtype: torch.dtype, device: torch.device, cfg, tokens, pos,
                warmup: int = 0) -> dict:
    """``warmup`` steps and one measured step of a GPTModel with all-gather core attention (CP=1) under ``cfg``."""
    from megatron_longctx.megatron.memory_spec import install

    features = {"cp_algorithm": "allgather"}
    if dtype == torch.float32 and device.type == "cuda":  # float32 numerics: the reference kernel, by name
        features["cp_kernel_backend"] = "reference"
    model, _ = build_gpt(shape, seq, dtype, features)
    model = model.to(device)
    handle = install(model, cfg)
    calls = _AttentionCalls(model)
    try:
        for _ in range(warmup):
            _peak_step(model, tokens, pos, device)
        run = _peak_step(model, tokens, pos, device)
        stats = None
        if handle.offloader is not None:
            handle.offloader.synchronize()
            stats = dataclasses.asdict(handle.offloader.stats)
    finally:
        calls.remove()
        handle.remove()
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {**run, "steps": warmup + 1, "offloader": stats, "attention_modes": sorted(calls.modes),
            "attention_modules": calls.modules, "attention_max_rows": calls.max_rows}


def _mismatches(ref: tuple, got: tuple) -> list[str]:
    """``torch.testing.assert_close`` of the loss and every gradient at float32 tolerances; each failure in one line."""
    (l_ref, g_ref), (l_got, g_got) = ref, got
    out = []
    if set(g_ref) != set(g_got):
        out.append(f"gradient keys differ: {sorted(set(g_ref) ^ set(g_got))}")
    for name, want in [("loss", l_ref), *g_ref.items()]:
        have = l_got if name == "loss" else g_got.get(name)
        if have is None:
            continue
        if name != "loss" and not want.abs().sum() > 0:
            out.append(f"{name}: the reference gradient is zero")
        try:
            torch.testing.assert_close(have, want, rtol=_F32_RTOL, atol=_F32_ATOL * want.abs().max().item())
        except AssertionError as exc:
            out.append(f"{name}: " + " ".join(line.strip() for line in str(exc).splitlines() if line.strip()))
    return out


def _replay_checks(name: str, run: dict, seq: int, tiles: int, layers: int, input_bytes: int) -> list[str]:
    """What a run of ``name`` must show: which attention passes ran, and the offloader's row reads."""
    from megatron_longctx.memory.tiled_recompute import tile_bounds

    problems = []
    n_tiles = len(tile_bounds(seq, tiles))
    if run["attention_modules"] != layers:
        problems.append(f"{name}: {run['attention_modules']} ContextParallelAttention modules, expected {layers}")
    if name == "full":
        if run["attention_modes"] != ["whole"]:
            problems.append(f"full: attention ran in passes {run['attention_modes']}, expected whole-sequence calls")
    else:
        if run["attention_modes"] != sorted(["collect", "attend", "kv_grad"]):
            problems.append(f"{name}: attention ran in passes {run['attention_modes']}, expected collect, attend, "
                            "kv_grad only")
        if run["attention_max_rows"] > -(-seq // n_tiles):
            problems.append(f"{name}: an attention call had {run['attention_max_rows']} query rows, more than a tile")
    stats = run["offloader"]
    if name == "tiled_offload":
        steps = run["steps"]
        # Each pass reads every tile of every layer input once; nothing reads an input whole or prefetches it.
        want = {"offloaded_tensors": steps * layers, "offloaded_bytes": steps * layers * input_bytes,
                "row_fetches": steps * 3 * n_tiles * layers, "fetched_bytes": 3 * stats["offloaded_bytes"],
                "prefetched_groups": 0, "kept_over_bound_bytes": 0}
        for key, value in want.items():
            if stats[key] != value:
                problems.append(f"tiled_offload: offloader {key} = {stats[key]}, expected {value}")
        if not stats["row_fetches"] > 0:
            problems.append("tiled_offload: no layer input was read back by rows")
    return problems


def _replay_numerics(device: torch.device, sizes: Sizes) -> dict:
    """float32 loss and every parameter gradient of the tiled replay (with and without the offload)
    against plain full recompute, ``torch.testing.assert_close``."""
    from megatron_longctx.attention import tiled

    shape, seq = sizes.gpt_model, sizes.tiled_numerics_seq
    tokens, pos = batch(shape, seq, device)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # float32 matmuls, no TF32: the tolerances are float32's
    try:
        runs = {name: _replay_run(shape, seq, torch.float32, device, cfg, tokens, pos)
                for name, cfg in _replay_configs(device, _NUMERICS_TILES).items()}
    finally:
        torch.set_float32_matmul_precision(precision)
    out: dict[str, Any] = {"shape": shape, "seq": seq, "dtype": "float32", "tiles": _NUMERICS_TILES,
                           "key_block": tiled.KEY_BLOCK, "rtol": _F32_RTOL, "atol_of_max": _F32_ATOL,
                           "problems": []}
    input_bytes = seq * tokens.shape[0] * shape["hidden_size"] * 4  # one layer input [s, b, h], float32
    for name, run in runs.items():
        out["problems"] += _replay_checks(name, run, seq, _NUMERICS_TILES, shape["num_layers"], input_bytes)
        row = {"attention_modes": run["attention_modes"], "attention_max_rows": run["attention_max_rows"],
               "offloader": run["offloader"]}
        if name != "full":
            row.update(compare(runs["full"]["result"], run["result"]))
            row["mismatches"] = _mismatches(runs["full"]["result"], run["result"])
            out["problems"] += [f"{name}: {m}" for m in row["mismatches"]]
        out[name] = row
    return out


def _replay_memory(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    """One step's peak memory of the three configurations (after a warm-up step each), in the device dtype,
    at a sequence where one layer's activations over the whole sequence set plain full recompute's peak."""
    shape, seq, dtype = sizes.tiled_model, sizes.tiled_memory_seq, dtype_for(device)
    tokens, pos = batch(shape, seq, device)
    out: dict[str, Any] = {"shape": shape, "seq": seq, "dtype": str(dtype), "tiles": _MEMORY_TILES, "problems": []}
    input_bytes = seq * tokens.shape[0] * shape["hidden_size"] * torch.empty(0, dtype=dtype).element_size()
    ref, last_s = None, 0.0
    for name, cfg in _replay_configs(device, _MEMORY_TILES).items():
        if last_s and budget.left() < 3 * last_s:
            out[name] = {"status": "skipped", "reason": "time budget"}
            out["problems"].append(f"{name}: not measured (time budget)")
            continue
        t0 = time.monotonic()
        run = _replay_run(shape, seq, dtype, device, cfg, tokens, pos, warmup=1)
        last_s = time.monotonic() - t0
        out["problems"] += _replay_checks(name, run, seq, _MEMORY_TILES, shape["num_layers"], input_bytes)
        row: dict[str, Any] = {"step_s": run["seconds"], "attention_modes": run["attention_modes"],
                               "offloader": run["offloader"]}
        if run["peak_bytes"] is not None:
            row.update(peak_gib=run["peak_bytes"] / 2**30,
                       step_peak_gib=(run["peak_bytes"] - run["start_bytes"]) / 2**30)
        if ref is None:
            ref = run["result"]
        else:  # informational: the same comparison in the device dtype (bf16 on a GPU)
            row.update(compare(ref, run["result"]))
        out[name] = row
    if device.type == "cuda" and all("step_peak_gib" in out.get(n, {}) for n in ("full", "tiled", "tiled_offload")):
        full, tiled_, offl = (out[n]["step_peak_gib"] for n in ("full", "tiled", "tiled_offload"))
        out.update(tiled_peak_reduction=1 - tiled_ / full, offload_peak_reduction=1 - offl / tiled_)
        if not tiled_ < 0.9 * full:
            out["problems"].append(f"tiled replay peak {tiled_:.3f} GiB is not below 0.9 x full recompute's {full:.3f}")
        if not offl < 0.9 * tiled_:
            out["problems"].append(f"tiled replay + host offload peak {offl:.3f} GiB is not below 0.9 x the tiled "
                                   f"replay's {tiled_:.3f}")
    elif device.type != "cuda":
        out["note"] = "CPU: disk target (host offload cannot lower CPU memory); no peak here"
    return out


def section_tiled_replay(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    """Full recompute replayed in sequence tiles (``--longctx-recompute-tiles``, all-gather core attention at
    CP=1), alone and with the checkpoint offload handing each tile's layer input back (host: a row range
    of the pinned pool buffer copied on the side stream): float32 loss and gradients against plain full
    recompute, which attention passes ran, the offloader's row reads, and one step's peak memory of each."""
    require_megatron()
    with single_rank_megatron(device):
        numerics = _replay_numerics(device, sizes)
        memory = _replay_memory(device, sizes, budget)
    errs = [numerics[n][k] for n in ("tiled", "tiled_offload") for k in ("loss_rel_err", "grad_max_rel_err")]
    problems = numerics["problems"] + memory["problems"]
    return {"numerics": numerics, "memory": memory, "numerics_rel_err": max(errs), "problems": problems,
            "status": "ok" if not problems else "failed"}
