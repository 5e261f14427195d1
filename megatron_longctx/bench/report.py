"""Benchmark output: ratios and parity against the baseline, the JSON file, a markdown table, PNG plots."""

from __future__ import annotations

import math
import os
from typing import Any, Optional

from megatron_longctx.bench import harness

SCHEMA = "megatron-longctx-bench/1"
LOSS_RTOL = 1e-3  # float32: different attention split and reduction order, a few Adam steps
GRAD_NORM_RTOL = 1e-3
# bf16 (8 significant bits, relative step 2^-8 = 3.9e-3): the same differences, rounded in bf16
BF16_LOSS_RTOL = 1e-2
BF16_GRAD_NORM_RTOL = 3e-2


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def step_cost(point: dict[str, Any]) -> float:
    """The time a point is compared by: the slowest rank's CPU-seconds per step (wall time in older files)."""
    return point.get("cpu_s_per_step") or point["step_time_s"]


def annotate(sweep: list[dict[str, Any]], baseline: str | list[str], time_reference: Optional[str] = None,
             bf16: bool = False) -> None:
    """Add ratios to, and loss / grad-norm parity with, the baseline at the same sequence length (in place).

    ``baseline``: a name, or names in order of preference (the first measured at a length is that
    length's reference, named in ``parity_reference``).  ``time_reference`` (optional): also
    ``time_ratio_vs_<name>`` against that configuration.  ``bf16``: the run's precision, whose
    tolerances (:data:`BF16_LOSS_RTOL`) decide parity.
    """
    loss_rtol, norm_rtol = (BF16_LOSS_RTOL, BF16_GRAD_NORM_RTOL) if bf16 else (LOSS_RTOL, GRAD_NORM_RTOL)
    names = [baseline] if isinstance(baseline, str) else list(baseline)
    base: dict[int, dict[str, Any]] = {}
    for name in reversed(names):
        base.update({p["seq_length"]: p for p in sweep if p["config"] == name and p.get("status") == "ok"})
    if time_reference:
        tref = {p["seq_length"]: p for p in sweep if p["config"] == time_reference and p.get("status") == "ok"}
        for point in sweep:
            ref = tref.get(point["seq_length"])
            ok = point.get("status") == "ok" and ref is not None
            point[f"time_ratio_vs_{time_reference}"] = step_cost(point) / step_cost(ref) if ok else None
    for point in sweep:
        ref = base.get(point["seq_length"])
        if point.get("status") != "ok" or ref is None:
            for key in ("time_ratio_vs_baseline", "mem_ratio_vs_baseline", "loss_max_rel_diff",
                        "grad_norm_max_rel_diff", "parity_ok"):
                point.setdefault(key, None)
            continue
        point["parity_reference"] = ref["config"]
        point["time_ratio_vs_baseline"] = step_cost(point) / step_cost(ref)
        point["mem_ratio_vs_baseline"] = point["peak_mem_bytes"] / max(1, ref["peak_mem_bytes"])
        n = min(len(point["losses"]), len(ref["losses"]))
        point["loss_max_rel_diff"] = max(_rel(a, b) for a, b in zip(point["losses"][:n], ref["losses"][:n]))
        point["grad_norm_max_rel_diff"] = max(_rel(a, b) for a, b in zip(point["grad_norms"][:n], ref["grad_norms"][:n]))
        point["parity_ok"] = bool(point["loss_max_rel_diff"] <= loss_rtol
                                  and point["grad_norm_max_rel_diff"] <= norm_rtol)


def write_json(result: dict[str, Any], path: str) -> None:
    def clean(o: Any) -> Any:
        if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
            return None
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [clean(v) for v in o]
        return o

    harness.write_json(path, clean(result))


def _fmt(value: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value / scale, spec)


def _optimizer_line(meta: dict[str, Any]) -> str:
    if not meta.get("distributed_optimizer"):  # an older bench.json did not say: it was this
        return "Megatron's optimizer, all of Adam's moments on every rank"
    return ("Megatron's distributed optimizer (Adam's moments sharded over the ranks) on every row; the "
            "model-state rows' Adam is off the device, its moments sharded the same way")


def markdown(result: dict[str, Any]) -> str:
    """The sweep as a markdown table (one row per configuration and sequence length) + max-seq lines."""
    meta, shape = result["meta"], result["meta"]["shape"]
    swiglu = shape.get("activation") == "swiglu" or shape.get("swiglu")  # an older bench.json: a swiglu flag
    tref = meta.get("time_reference")
    ratio_key = f"time_ratio_vs_{tref}" if tref else None
    lines = [f"### megatron-longctx regression benchmark ({meta['device']}, {meta['world_size']} ranks)", "",
             f"Model ({meta.get('preset', 'custom')}): {shape['num_layers']} layers, hidden {shape['hidden_size']}, "
             f"{shape['num_attention_heads']} heads ({shape['num_query_groups']} KV groups), ffn "
             f"{shape['ffn_hidden_size']}{' SwiGLU' if swiglu else ''}, "
             f"{shape.get('normalization', 'LayerNorm')}, vocabulary {shape['vocab_size']}, "
             f"{'bf16 mixed precision' if shape.get('bf16') else 'float32'}; {_optimizer_line(meta)}; median of "
             f"{meta['steps']} timed steps after {meta['warmup']} warm-up; time = the slowest rank's CPU-seconds "
             f"per step; ratios against rows of the same run (load average {meta.get('loadavg', '?')}); ref = "
             "megatron-unfused, or megatron-flash where the unfused scores would not fit.", "",
             "| config | seq | CPU s/step | µs/token | × ref time | × flash+recompute time | peak MiB/rank "
             "| × ref mem | loss Δrel | grad-norm Δrel | parity |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in sorted(result["sweep"], key=lambda p: (p["seq_length"], _order(result, p["config"]))):
        if p.get("status") != "ok":
            lines.append(f"| {p['config']} | {p['seq_length']} | {p['status']} | | | | | | | | |")
            continue
        parity = {True: "ok", False: "BROKEN", None: "–"}[p.get("parity_ok")]
        per_token = p.get("cpu_us_per_token")
        lines.append(
            f"| {p['config']} | {p['seq_length']} | {step_cost(p):.3f} | {_fmt(per_token, '.1f')} "
            f"| {_fmt(p.get('time_ratio_vs_baseline'), '.2f')} | {_fmt(p.get(ratio_key) if ratio_key else None, '.2f')} "
            f"| {p['peak_mem_bytes'] / 2**20:.1f} "
            f"| {_fmt(p.get('mem_ratio_vs_baseline'), '.2f')} | {_fmt(p.get('loss_max_rel_diff'), '.1e')} "
            f"| {_fmt(p.get('grad_norm_max_rel_diff'), '.1e')} | {parity} |")
    for c in result["configs"]:
        if c["status"] != "ok":
            lines.append(f"| {c['name']} | – | {c['status']} | | | | | | | | |")
    lines += _max_seq_lines(result.get("max_seq"))
    tc = result.get("time_check")
    if tc and tc.get("status") == "ok":
        med = tc["median_cpu_us_per_token"]
        lines += ["", f"**Time per token** at {tc['seq_length']} tokens (fresh job per measurement, medians of "
                      f"{tc['rounds']} alternating rounds): {tc['plugin']} {med[tc['plugin']]:.0f} µs / {tc['baseline']} "
                      f"{med[tc['baseline']]:.0f} µs = {tc['ratio']:.2f}× (target ≤ {tc['target']}×: "
                      f"{'met' if tc['meets_target'] else 'not met'})"]
    elif tc:
        lines += ["", f"**Time per token**: {tc['status']}"]
    return "\n".join(lines) + "\n"


def _max_seq_lines(ms: Optional[dict[str, Any]]) -> list[str]:
    if not ms:
        return []
    from megatron_longctx.bench.headline import headline_line, model_states_line

    lines = ["", f"**Max trainable sequence** under {ms['budget_bytes'] / 2**20:.0f} MiB per rank "
                 f"({ms['enforcement']}; probes {ms.get('probes', 'in one process')}):", ""]
    for name, r in ms["results"].items():
        bound = "≥ " if r.get("at_cap") else ""
        lines.append(f"- {name}: {bound}{r['max_seq']} tokens ({len(r['probes'])} probes)")
    if "max_seq_ratio_vs_strongest" in ms and (ms.get("best_plugin") or not ms.get("model_states_headline")):
        lines += ["", f"**{headline_line(ms)}**"]
    if ms.get("model_states_headline"):
        lines += ["", f"**{model_states_line(ms['model_states_headline'])}**"]
    return lines


def _order(result: dict[str, Any], name: str) -> int:
    names = [c["name"] for c in result["configs"]]
    return names.index(name) if name in names else len(names)


def plots(result: dict[str, Any], out_dir: str) -> list[str]:
    """memory_vs_seq.png and tokens_per_s_vs_seq.png (log-log); [] when matplotlib is not installed."""
    plt = harness.pyplot()
    if plt is None:
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
        harness.log_log_axes(ax, ylabel, legend_size=8)
        ax.set_title(f"{ylabel} vs sequence length ({result['meta']['device']})", fontsize=9)
        written.append(harness.save_figure(fig, os.path.join(out_dir, fname)))
    return written
