"""One prepared accelerator run: what the CPU test suite cannot check.

Sections (each with its own time budget; an error in one is recorded and the next one runs):

* ``environment`` — torch, CUDA, device, optional packages, the measured bf16 matmul rate;
* ``kernels`` — every case of ``tests/kernels/cases.py`` (offset/rectangular blocks, windows, GQA/MQA,
  MLA, ``s_q = 1``...) in bf16 and fp16 on each CUDA backend against the float64 ``reference``:
  outputs, log-sum-exp and gradients; plus forward/backward TFLOPS of a long causal call;
* ``ring`` — the real ring schedule of P = 2, 4, 8 ranks for causal, windowed and packed (THD)
  layouts, run block by block on one GPU against one kernel call (per document when packed): outputs
  and gradients, pair counts, efficiency;
* ``packed`` — the packed ring as training runs it: one many-document call per ring step (mixed lengths,
  windows, GQA, sinks) over documents of several kernel tiles, against float64, with its kernel calls
  per step counted;
* ``offload`` — a GPTModel trained plain and with ``memory_spec.install`` offloading every layer: peak
  memory, gradients, host-link bandwidth and how much of the copies hid behind compute;
* ``offload_one_connection`` — the same in a child process under ``CUDA_DEVICE_MAX_CONNECTIONS=1``
  (Megatron's setting for TP/SP overlap, which can serialise the offload side stream);
* ``gpt_step`` — one training step of a tiny GPTModel with ContextParallelAttention at CP=1 against
  Megatron's own attention;
* ``tiled_replay`` — full recompute replayed in sequence tiles (``--longctx-recompute-tiles``, all-gather
  core attention at CP=1), alone and with the checkpoint offload reading each layer input back from the
  host one tile at a time: float32 loss and gradients against plain full recompute, the offloader's row
  reads, and one step's peak memory of plain full recompute, the tiled replay, and the tiled replay with
  the offload;
* ``fused_replay`` — one layer under Megatron's DDP with ``gradient_accumulation_fusion`` (``main_grad``):
  the tiled replay's ``main_grad`` against plain full recompute's;
* ``residual_grad`` — the residual-gradient offload against the same tiled replay without it: gradients,
  rows streamed, peak, and the share of the copy time hidden behind compute;
* ``model_states`` — a Llama-shaped GPTModel trained plain and with its weights and gradients streamed layer
  by layer through device slots from pinned host memory (``--longctx-model-state-offload host``): gradients,
  the peak against the slots plus the plain step's non-state memory, and the share of the copies hidden; then
  streamed from files (``disk``): gradients, and every load after each pass's first read ahead;
* ``max_seq`` — a numerics check of every memory feature against none, then the longest sequence one GPU
  trains for a Llama-3-8B-shaped stack of two layers with every feature on.

Writes one JSON file (after every section, so a killed run keeps what finished) and prints a table.
Schema ``gpu_check/2``; the keys a calibration reads are ``sections.kernels.tflops.<backend>.<dtype>.
{fwd,bwd,seq,heads}`` (TFLOP/s of one causal call) and ``sections.environment.matmul_bf16_tflops``.  ``--allow-cpu`` runs the same code paths on the CPU with tiny sizes (a dry run for CI).
Each section states what it must cover and is "ok" only when all of it ran and passed; otherwise
"failed", "error", "incomplete" (the time budget left something out) or "unavailable" (a package it
needs is absent).  NaN, or an inf the float64 reference does not have (with its sign), fails every
comparison; lse is compared in absolute nats.
Exit status: 0 every section "ok", 1 any other status, 3 no CUDA device
(and no ``--allow-cpu``), 4 NVIDIA GPUs present but unusable by this torch (driver mismatch...).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from typing import Any, Callable

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # this repository, and the section modules beside this file

from gpu_check_attention import section_kernels, section_ring, section_windows  # noqa: E402
from gpu_check_common import (CPU_SIZES, ERROR, GPU_SIZES, INCOMPLETE, OK, UNAVAILABLE, Budget,  # noqa: E402
                              BudgetSkip, Sizes, Skip, _time, copy_summary, worst)
from gpu_check_packed import section_packed  # noqa: E402
from gpu_check_gpt import section_gpt_step  # noqa: E402
from gpu_check_memory import section_max_seq, section_offload, section_tiled_replay  # noqa: E402
from gpu_check_model_states import section_model_states  # noqa: E402
from gpu_check_replay import section_fused_replay, section_residual_grad  # noqa: E402

SCHEMA = "gpu_check/2"


def section_environment(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda_available": torch.cuda.is_available(), "device": str(device)}
    info["cuda_device_max_connections"] = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    info["matmul_bf16_tflops"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 2), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
        n = 8192
        a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
        info["matmul_bf16_tflops"] = 2 * n ** 3 / _time(lambda: a @ b, device, reps=10) / 1e12
    for module in ("megatron.core", "flash_attn", "transformer_engine"):
        try:
            mod = __import__(module, fromlist=["__version__"])
            info[module] = getattr(mod, "__version__", "present")
        except Exception as exc:  # noqa: BLE001 - absent or broken: record why
            info[module] = f"absent ({type(exc).__name__})"
    return info


def section_offload_one_connection(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    """``offload`` again in a child process with CUDA_DEVICE_MAX_CONNECTIONS=1 (read at CUDA start)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "child.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--out", out, "--sections", "offload", "--child"]
        if device.type != "cuda":
            cmd.append("--allow-cpu")
        env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="1")
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(budget.left(), 10))
        except subprocess.TimeoutExpired:
            raise BudgetSkip("time budget (the child did not finish)")
        if not os.path.exists(out):
            return {"status": ERROR, "error": f"child exited {proc.returncode}: {proc.stderr[-2000:]}"}
        with open(out, encoding="utf-8") as fh:
            child = json.load(fh)["sections"]["offload"]
    child["child_returncode"] = proc.returncode
    return child


# Seconds each section may take (the sum, 440, leaves the 480 s limit of gpu_check.sh room for the start);
# a section that runs out before covering what it must is "incomplete", which fails the run.
SECTIONS: dict[str, tuple[Callable, float]] = {
    "environment": (section_environment, 20),
    "kernels": (section_kernels, 40),
    "ring": (section_ring, 35),
    "windows": (section_windows, 25),
    "packed": (section_packed, 40),
    "offload": (section_offload, 40),
    "offload_one_connection": (section_offload_one_connection, 55),
    "gpt_step": (section_gpt_step, 25),
    "tiled_replay": (section_tiled_replay, 30),
    "fused_replay": (section_fused_replay, 15),
    "residual_grad": (section_residual_grad, 25),
    "model_states": (section_model_states, 25),
    "max_seq": (section_max_seq, 65),
}


def run(sections: list[str], device: torch.device, sizes: Sizes, out_path: str, scale: float,
        options: dict | None = None) -> dict:
    report: dict[str, Any] = {"schema": SCHEMA, "device": str(device), "dry_run": device.type != "cuda",
                              "sections": {}}
    for name in sections:
        fn, seconds = SECTIONS[name]
        budget = Budget(seconds * scale)
        t0 = time.monotonic()
        try:
            result = fn(device, sizes, budget, **(options or {}).get(name, {}))
            result.setdefault("status", OK)
        except BudgetSkip as exc:
            result = {"status": INCOMPLETE, "reason": str(exc)}
        except Skip as exc:
            result = {"status": UNAVAILABLE, "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
            result = {"status": ERROR, "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=8)}
        result["seconds"] = round(time.monotonic() - t0, 2)
        report["sections"][name] = result
        with open(out_path, "w", encoding="utf-8") as fh:  # after every section: a killed run keeps the rest
            json.dump(report, fh, indent=2, default=str)
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    return report


def _summary(name: str, r: dict) -> str:
    if "reason" in r or "error" in r:
        return r.get("reason") or r.get("error", "")
    if name == "environment":
        mm = r.get("matmul_bf16_tflops")
        return (f"torch {r['torch']}, {r.get('name', r['device'])}, megatron {r['megatron.core']}"
                + (f", bf16 matmul {mm:.0f} TFLOPS" if mm else ""))
    if name == "kernels":
        parts = []
        for backend, entry in r["backends"].items():
            speeds = ", ".join(f"{dt} {v['fwd']:.0f}/{v['bwd']:.0f}" for dt, v in r["tflops"].get(backend, {}).items())
            bad = entry.get("bad_cases") or ([entry["reason"]] if "reason" in entry else [])
            parts.append(f"{backend}: {entry['status']}" + (f" (TFLOPS fwd/bwd {speeds})" if speeds else "")
                         + (f" [{'; '.join(bad[:4])}]" if bad else ""))
        parts += [f"{b}: not here ({why})" for b, why in r.get("not_here", {}).items()]
        return "; ".join(parts)
    if name == "packed":
        by: dict = {}
        for x in r["rows"]:
            calls = (f"{x['max_forward_calls_per_step']}/{x['max_backward_calls_per_step']}" if x["status"] == OK
                     else x["status"])
            if "packed_over_dense_per_pair" in x:
                calls += f" x{x['packed_over_dense_per_pair']:.2f}"
            by.setdefault(x["backend"], []).append(f"{x['layout'].split('+')[0]} cp{x['cp']} {calls}")
        return "calls/step fwd/bwd (x packed/dense time per pair): " + "; ".join(f"{b}: " + ", ".join(v) for b, v in by.items())
    if name == "ring":
        return "; ".join(f"{x['layout']} cp{x['cp']}: " + (f"{x['efficiency']:.0%}" if x["status"] == OK else x["status"])
                         for x in r["rows"])
    if name.startswith("offload"):
        if "peak_reduction" in r:
            return (f"peak {r['plain_peak_gib']:.1f} -> {r['offload_peak_gib']:.1f} GiB, time "
                    f"{r['plain_s']:.2f} -> {r['offload_s']:.2f} s, {copy_summary(r)}")
        return f"grads max rel err {r['grad_max_rel_err']:.1e}; {r.get('note', '')}"
    if name == "model_states":
        disk = (f"disk: grads {r['disk_grad_max_rel_err']:.1e}, {r['disk_s']:.3f} s, "
                f"{r['disk_reads_ahead_used']}/{r['disk_loads']} loads read ahead")
        if "streamed_peak_gib" in r:
            return (f"grads max rel err {r['grad_max_rel_err']:.1e}; peak {r['plain_peak_gib']:.2f} -> "
                    f"{r['streamed_peak_gib']:.2f} GiB (bound {r['bound_gib']:.2f}); time {r['plain_s']:.3f} -> "
                    f"{r['streamed_s']:.3f} s, {copy_summary(r)}; {disk}")
        return f"grads max rel err {r['grad_max_rel_err']:.1e}; {disk}; {r.get('note', '')}"
    if name == "gpt_step":
        return f"loss rel err {r['step1']['loss_rel_err']:.1e}, grads {r['step1']['grad_max_rel_err']:.1e}"
    if name == "tiled_replay":
        mem = r["memory"]
        peaks = [mem.get(n, {}).get("step_peak_gib") for n in ("full", "tiled", "tiled_offload")]
        where = ("peak full/tiled/+offload " + "/".join(f"{p:.2f}" for p in peaks) + " GiB"
                 if None not in peaks else "no peak (CPU)")
        return f"float32 rel err {r['numerics_rel_err']:.1e}; {where}; {len(r['problems'])} problems"
    if name == "fused_replay":
        return (f"main_grad max rel err {r['grad_max_rel_err']:.1e} vs full recompute ({r['kernel']}, "
                f"{r['fused_linears']} fused linears)")
    if name == "residual_grad":
        hidden = r.get("hidden_share")
        return (f"grads rel err {r['grad_max_rel_err']:.1e}; {r['streamed_bytes_per_step'] / 2**20:.0f} MiB streamed"
                + (f", peak {r['dense_step_peak_gib']:.2f} -> {r['streamed_step_peak_gib']:.2f} GiB, time "
                   f"{r['dense_s']:.2f} -> {r['streamed_s']:.2f} s, {copy_summary(r)}" if hidden is not None
                   else f"; {r.get('note', '')}"))
    if name == "windows":
        return "; ".join(
            f"{b}: {e['status']}" + (f" (err {worst(e['max_err'].values()):.1e}, us/token x{e['us_per_token_growth']:.2f},"
                                      f" keys/row x{e['keys_per_row_growth']:.2f} for 4x tokens)" if "rows" in e else "")
            for b, e in r["backends"].items())
    if name == "max_seq":
        return (f"max trained {r['max_trained_seq']:,} tokens (stopped by {r['stopped_by']}); "
                f"numerics rel err {r['numerics_rel_err']:.1e}")
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--allow-cpu", action="store_true", help="dry run on the CPU with tiny sizes")
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's time budget")
    p.add_argument("--cases", nargs="+", help="kernels section: only these cases of tests/kernels/cases.py")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from megatron_longctx.kernels.cuda_presence import unusable_gpu_reason

    reason = None if torch.cuda.is_available() else unusable_gpu_reason()
    if reason is not None and not args.child:
        print(f"gpu_check: ERROR: {reason}", file=sys.stderr)
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"schema": SCHEMA, "status": "gpu_unusable", "reason": reason, "torch": torch.__version__},
                      fh, indent=2)
        if not args.allow_cpu:
            return 4
    if torch.cuda.is_available():
        device, sizes = torch.device("cuda", torch.cuda.current_device()), GPU_SIZES
    elif args.allow_cpu:
        device, sizes = torch.device("cpu"), CPU_SIZES
    else:
        print("gpu_check: no CUDA device: nothing to check (use --allow-cpu for a dry run on the CPU)")
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"schema": SCHEMA, "status": "no_cuda", "torch": torch.__version__}, fh, indent=2)
        return 3
    options = {"kernels": {"cases": args.cases}} if args.cases else {}
    report = run(args.sections, device, sizes, args.out, args.budget_scale, options)
    print(f"{'section':<24}{'status':<10}{'s':>7}  summary")
    for name, r in report["sections"].items():
        try:
            summary = _summary(name, r)
        except Exception as exc:  # noqa: BLE001 - the table must print whatever a section returned
            summary = f"(no summary: {type(exc).__name__})"
        print(f"{name:<24}{r['status']:<10}{r['seconds']:>7.1f}  {summary}")
    print(f"wrote {args.out}")
    bad = [n for n, r in report["sections"].items() if r["status"] != OK]
    if bad:
        listed = ", ".join(f"{n} ({report['sections'][n]['status']})" for n in bad)
        print(f"gpu_check: FAILED: {listed}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
