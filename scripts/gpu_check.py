"""One prepared accelerator run: what the CPU test suite cannot check.

Sections (each with its own time budget; an error in one is recorded and the next one runs):

* ``environment`` — torch, CUDA, device, optional packages (megatron-core, flash-attn);
* ``kernels`` — the CUDA block kernels (``sdpa_cuda``, ``flash_attn``) against the ``reference``
  backend: outputs, log-sum-exp and gradients, plus forward/backward time and TFLOPS;
* ``ring_overhead`` — the zigzag ring schedule of P ranks run block by block on one GPU (every block
  call and online-softmax merge a ring rank makes) against one kernel call over the same tokens:
  efficiency, per-block overhead, and the error of the assembled output;
* ``offload`` — a layer stack trained with and without the activation offloader (pinned host pool):
  ``max_memory_allocated``, step time, measured host-link bandwidth, how much of the copies hid
  behind compute, and that gradients agree;
* ``max_seq`` — the longest sequence one GPU trains for a Llama-3-8B-shaped stack of a few layers
  with every memory feature on (binary search until out of memory or out of time; needs megatron-core).

Writes one JSON file (after every section, so a killed run keeps what finished) and prints a table.
Uses only torch and this repository.  ``--allow-cpu`` runs the same code paths on the CPU with tiny
sizes (a dry run for CI).  Exit status: 0 all sections ran or were skipped with a reason, 1 a section
failed, 3 no CUDA device (and no ``--allow-cpu``).
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

from gpu_check_attention import section_kernels, section_ring_overhead  # noqa: E402
from gpu_check_common import CPU_SIZES, GPU_SIZES, Budget, Sizes, Skip  # noqa: E402
from gpu_check_memory import section_max_seq, section_offload  # noqa: E402


def section_environment(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda_available": torch.cuda.is_available(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 2), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version())
    for module in ("megatron.core", "flash_attn", "transformer_engine"):
        try:
            mod = __import__(module, fromlist=["__version__"])
            info[module] = getattr(mod, "__version__", "present")
        except Exception as exc:  # noqa: BLE001 - absent or broken: record why
            info[module] = f"absent ({type(exc).__name__})"
    return info


SECTIONS: dict[str, tuple[Callable, float]] = {
    "environment": (section_environment, 30),
    "kernels": (section_kernels, 60),
    "ring_overhead": (section_ring_overhead, 60),
    "offload": (section_offload, 60),
    "max_seq": (section_max_seq, 210),
}


def run(sections: list[str], device: torch.device, sizes: Sizes, out_path: str, scale: float) -> dict:
    report: dict[str, Any] = {"device": str(device), "dry_run": device.type != "cuda", "sections": {}}
    for name in sections:
        fn, seconds = SECTIONS[name]
        budget = Budget(seconds * scale)
        t0 = time.monotonic()
        try:
            result = fn(device, sizes, budget)
            result.setdefault("status", "ok")
        except Skip as exc:
            result = {"status": "skipped", "reason": str(exc)}
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
            result = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
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
    if r["status"] in ("skipped", "error"):
        return r.get("reason") or r.get("error", "")
    if name == "environment":
        return f"torch {r['torch']}, {r.get('name', r['device'])}, megatron {r['megatron.core']}"
    if name == "kernels":
        parts = []
        for k, v in r.items():
            if isinstance(v, dict) and "status" in v:
                t = v.get("timing", {})
                speed = f" {t['fwd_tflops']:.0f}/{t['bwd_tflops']:.0f} TFLOPS" if "fwd_tflops" in t else ""
                parts.append(f"{k}: {v['status']}{speed}")
        return "; ".join(parts)
    if name == "ring_overhead":
        return "; ".join(f"cp{x['cp']}: {x['efficiency']:.0%}, {x['overhead_per_block_us']:.0f} us/block"
                         for x in r["rows"] if "efficiency" in x)
    if name == "offload":
        if "peak_reduction" in r:
            return (f"peak {r['plain_peak_gib']:.1f} -> {r['offload_peak_gib']:.1f} GiB, time "
                    f"{r['plain_s']:.2f} -> {r['offload_s']:.2f} s, hidden {r['hidden_share']:.0%}")
        return f"grads max rel err {r['grad_max_rel_err']:.1e}; {r.get('note', '')}"
    if name == "max_seq":
        return f"max trained {r['max_trained_seq']:,} tokens (stopped by {r['stopped_by']})"
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--allow-cpu", action="store_true", help="dry run on the CPU with tiny sizes")
    p.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's time budget")
    args = p.parse_args(argv)
    if torch.cuda.is_available():
        device, sizes = torch.device("cuda", torch.cuda.current_device()), GPU_SIZES
    elif args.allow_cpu:
        device, sizes = torch.device("cpu"), CPU_SIZES
    else:
        print("gpu_check: no CUDA device: nothing to check (use --allow-cpu for a dry run on the CPU)")
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump({"status": "no_cuda", "torch": torch.__version__}, fh, indent=2)
        return 3
    report = run(args.sections, device, sizes, args.out, args.budget_scale)
    print(f"{'section':<15}{'status':<10}{'s':>7}  summary")
    for name, r in report["sections"].items():
        try:
            summary = _summary(name, r)
        except Exception as exc:  # noqa: BLE001 - the table must print whatever a section returned
            summary = f"(no summary: {type(exc).__name__})"
        print(f"{name:<15}{r['status']:<10}{r['seconds']:>7.1f}  {summary}")
    print(f"wrote {args.out}")
    return 1 if any(r["status"] in ("error", "failed") for r in report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
