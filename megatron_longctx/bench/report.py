"""Benchmark output: ratios and parity against the baseline, the JSON file, a markdown table, PNG plots."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

SCHEMA = "megatron-longctx-bench/1"
LOSS_RTOL = 1e-3  # float32: different attention split and reduction order, a few Adam steps
GRAD_NORM_RTOL = 1e-3


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def annotate(sweep: list[dict[str, Any]], baseline: str) -> None:
    """Add ratios to, and loss / grad-norm parity with, the baseline at the same sequence length (in place)."""
    base = {p["seq_length"]: p for p in sweep if p["config"] == baseline and p.get("status") == "ok"}
    for point in sweep:
        ref = base.get(point["seq_length"])
        if point.get("status") != "ok" or ref is None:
            for key in ("time_ratio_vs_baseline", "mem_ratio_vs_baseline", "loss_max_rel_diff",
                        "grad_norm_max_rel_diff", "parity_ok"):
                point.setdefault(key, None)
            continue
        point["time_ratio_vs_baseline"] = point["step_time_s"] / ref["step_time_s"]
        point["mem_ratio_vs_baseline"] = point["peak_mem_bytes"] / max(1, ref["peak_mem_bytes"])
        n = min(len(point["losses"]), len(ref["losses"]))
        point["loss_max_rel_diff"] = max(_rel(a, b) for a, b in zip(point["losses"][:n], ref["losses"][:n]))
        point["grad_norm_max_rel_diff"] = max(_rel(a, b) for a, b in zip(point["grad_norms"][:n], ref["grad_norms"][:n]))
        point["parity_ok"] = bool(point["loss_max_rel_diff"] <= LOSS_RTOL
                                  and point["grad_norm_max_rel_diff"] <= GRAD_NORM_RTOL)


def write_json(result: dict[str, Any], path: str) -> None:
    def clean(o: Any) -> Any:
        if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
            return None
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o

    with open(path, "w") as f:
        json.dump(clean(result), f, indent=1)


def _fmt(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value / scale, spec)


def markdown(result: dict[str, Any]) -> str:
    """The sweep as a markdown table (one row per configuration and sequence length) + max-seq lines."""
    meta = result["meta"]
    lines = [f"### megatron-longctx regression benchmark ({meta['device']}, {meta['world_size']} ranks)", "",
             f"Model: {meta['shape']['num_layers']} layers, hidden {meta['shape']['hidden_size']}, "
             f"{meta['shape']['num_attention_heads']} heads ({meta['shape']['num_query_groups']} KV groups); "
             f"median of {meta['steps']} timed steps after {meta['warmup']} warm-up; ratios are against the "
             "baseline measured in the same run.", "",
             "| config | seq | step s (median) | × baseline time | tokens/s | TFLOPS | peak MiB/rank | × baseline mem "
             "| loss Δrel | grad-norm Δrel | parity |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in sorted(result["sweep"], key=lambda p: (p["seq_length"], _order(result, p["config"]))):
        if p.get("status") != "ok":
            lines.append(f"| {p['config']} | {p['seq_length']} | {p['status']} | | | | | | | | |")
            continue
        parity = {True: "ok", False: "BROKEN", None: "–"}[p.get("parity_ok")]
        lines.append(
            f"| {p['config']} | {p['seq_length']} | {p['step_time_s']:.3f} | {_fmt(p.get('time_ratio_vs_baseline'), '.2f')} "
            f"| {p['tokens_per_s']:.0f} | {p['model_tflops']:.4f} | {p['peak_mem_bytes'] / 2**20:.1f} "
            f"| {_fmt(p.get('mem_ratio_vs_baseline'), '.2f')} | {_fmt(p.get('loss_max_rel_diff'), '.1e')} "
            f"| {_fmt(p.get('grad_norm_max_rel_diff'), '.1e')} | {parity} |")
    for c in result["configs"]:
        if c["status"] != "ok":
            lines.append(f"| {c['name']} | – | {c['status']} | | | | | | | | |")
    ms = result.get("max_seq")
    if ms:
        lines += ["", f"**Max trainable sequence** under {ms['budget_bytes'] / 2**20:.0f} MiB per rank "
                      f"({ms['enforcement']}):", ""]
        for name, r in ms["results"].items():
            bound = "≥ " if r.get("at_cap") else ""
            lines.append(f"- {name}: {bound}{r['max_seq']} tokens ({len(r['probes'])} probes)")
        if ms.get("ratio") is not None:
            lines.append(f"- ratio {ms['best']} / baseline: {'≥ ' if ms.get('ratio_is_lower_bound') else ''}"
                         f"{ms['ratio']:.1f}× (target ≥ {ms['target']}×: {'met' if ms['meets_target'] else 'not met'})")
    return "\n".join(lines) + "\n"


def _order(result: dict[str, Any], name: str) -> int:
    names = [c["name"] for c in result["configs"]]
    return names.index(name) if name in names else len(names)


def plots(result: dict[str, Any], out_dir: str) -> list[str]:
    """memory_vs_seq.png and tokens_per_s_vs_seq.png (log-log); [] when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for key, ylabel, fname, scale in (("peak_mem_bytes", "peak memory per rank (MiB)", "memory_vs_seq.png", 2**20),
                                      ("tokens_per_s", "tokens / s", "tokens_per_s_vs_seq.png", 1.0)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for c in result["configs"]:
            pts = sorted((p["seq_length"], p[key] / scale) for p in result["sweep"]
                         if p["config"] == c["name"] and p.get("status") == "ok")
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=c["name"])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{ylabel} vs sequence length ({result['meta']['device']})", fontsize=9)
        path = os.path.join(out_dir, fname)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
