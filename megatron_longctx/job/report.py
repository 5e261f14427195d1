"""The main job's closing report: loss curves side by side, the resume check, memory per rank, throughput."""

from __future__ import annotations

from statistics import median
from typing import Any

LOSS_RTOL = 1e-3  # float32 across a different attention split and reduction order, after Adam steps


def run_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps, median step time (first step excluded), tokens/s and peak memory per rank of one phase."""
    if not rows:
        return {"steps": [], "median_step_time_s": None, "median_tokens_per_s": None, "peak_mem_bytes_per_rank": []}
    timed = rows[1:] or rows
    times = [r["step_time_s"] for r in timed]
    ranks = len(rows[0]["peak_mem_bytes_per_rank"])
    tokens = sum(r["tokens"] for r in timed) / len(timed)  # --mix-short: steps of two lengths
    return {"steps": rows, "median_step_time_s": median(times), "median_tokens_per_s": tokens / median(times),
            "peak_mem_bytes_per_rank": [max(r["peak_mem_bytes_per_rank"][i] for r in rows) for i in range(ranks)]}


def compare_losses(plugin: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    base = {r["step"]: r for r in baseline}
    pairs = [(r, base[r["step"]]) for r in plugin if r["step"] in base]
    rel = [abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-12) for a, b in pairs]
    return {"steps_compared": len(pairs), "max_rel_loss_diff": max(rel) if rel else None, "loss_rtol": LOSS_RTOL,
            "losses_agree": bool(rel) and max(rel) <= LOSS_RTOL}


def _table(plugin: dict[str, Any], baseline: dict[str, Any]) -> list[str]:
    lines = [f"{'step':>5} {'plugin loss':>12} {'baseline loss':>14} {'rel diff':>10}"]
    base = {r["step"]: r for r in baseline["steps"]}
    for r in plugin.get("steps", []):
        b = base.get(r["step"])
        if b is not None:
            lines.append(f"{r['step']:>5} {r['loss']:>12.5f} {b['loss']:>14.5f} "
                         f"{abs(r['loss'] - b['loss']) / abs(b['loss']):>10.2e}")
    return lines


def render_summary(summary: dict[str, Any]) -> str:
    lines = ["", "=" * 78, "megatron-longctx run: summary (Megatron-LM's training loop)", "=" * 78]
    plugin, baseline = summary.get("plugin", {}), summary.get("baseline")
    lines.append(f"device {summary['device']}, {summary['world_size']} ranks, seq {summary['shape']['seq_length']}, "
                 f"global batch {summary['global_batch_size']}, {summary['train_steps']} steps")
    if baseline:
        lines += _table(plugin, baseline)
    rows = [("plugin", plugin)] + ([("baseline", baseline)] if baseline else [])
    lines += ["", f"{'run':<10} {'CP':>3} {'median step s':>14} {'tokens/s':>10} {'peak MiB/rank':>22}"]
    for name, run in rows:
        if run.get("steps"):
            peaks = "/".join(f"{p / 2**20:.0f}" for p in run["peak_mem_bytes_per_rank"])
            lines.append(f"{name:<10} {run['variant']['context_parallel_size']:>3} {run['median_step_time_s']:>14.3f} "
                         f"{run['median_tokens_per_s']:>10.0f} {peaks:>22}")
    if baseline and plugin.get("steps") and baseline.get("steps"):
        c = summary["comparison"]
        ratio = max(baseline["peak_mem_bytes_per_rank"]) / max(1, max(plugin["peak_mem_bytes_per_rank"]))
        lines.append(f"loss curves {'agree' if c['losses_agree'] else 'DIFFER'}: max rel diff "
                     f"{c['max_rel_loss_diff']:.2e} over {c['steps_compared']} steps (tolerance {c['loss_rtol']:.0e})")
        lines.append(f"peak memory per rank: baseline / plugin = {ratio:.2f}x")
    if summary.get("saved_iterations"):
        lines.append(f"checkpoints in {summary['checkpoint']}: iterations {summary['saved_iterations']}")
    if "resume" in summary:
        r = summary["resume"]
        lines.append(f"resume from iteration {r['loaded_step']}: "
                     f"{'reproduces' if r['ok'] else 'DOES NOT reproduce'} steps {r['steps']} bit for bit "
                     f"(max |loss diff| {r['max_abs_diff']:.1e})")
    return "\n".join(lines)
