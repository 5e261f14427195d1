"""Output of the scaling benchmark (:mod:`megatron_longctx.bench.scaling`): growth exponents, the JSON file,
a markdown table and a log-log PNG.

A row is one (series, sequence length): ``status`` ``ok`` (measured), ``skipped`` (does not fit: not run,
or killed past a budget; the reason says which, e.g. the predicted step over the time budget), ``failed``
(the job exited with an error: the reason has its exception) or ``planned`` (``--dry-run``).  Measured
rows carry ``step_s`` (seconds of the timed step), ``peak_mib`` (the largest rank's peak resident memory)
and ``planner_mib`` (the planner's prediction for the same configuration).
"""

from __future__ import annotations

import math
import os
import textwrap
from typing import Any, Optional, Sequence

from megatron_longctx.bench import harness

SCHEMA = "megatron-longctx-scaling/1"
MIB = 2**20


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares slope of ``log y`` on ``log x`` (``y ∝ x^slope``); ``None`` with fewer than two
    distinct positive ``x`` (or any ``y <= 0``)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y is not None and y > 0]
    if len(pts) != len(xs) or len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def measured(rows: Sequence[dict[str, Any]], series: str) -> list[dict[str, Any]]:
    """The series' measured rows, shortest first."""
    return sorted((r for r in rows if r["series"] == series and r["status"] == "ok"), key=lambda r: r["seq_length"])


def fits(rows: Sequence[dict[str, Any]], series_names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per series: growth exponents of s/step, of the peak memory per rank and of the memory above the
    fixed footprint (the calibration's, where there is one) over its measured lengths, and the ratios of
    µs/token and of MiB per 1K tokens between its longest and its shortest length."""
    out = {}
    for name in series_names:
        ok = measured(rows, name)
        seqs = [r["seq_length"] for r in ok]
        above = [r.get("above_fixed_mib") for r in ok]
        entry: dict[str, Any] = {
            "lengths": seqs,
            "time_exponent": fit_exponent(seqs, [r["step_s"] for r in ok]),
            "memory_exponent": fit_exponent(seqs, [r["peak_mib"] for r in ok]),
            "memory_above_fixed_exponent": fit_exponent(seqs, above) if all(a is not None for a in above) else None,
        }
        if len(ok) >= 2:
            entry["us_per_token_ratio"] = ok[-1]["us_per_token"] / ok[0]["us_per_token"]
            entry["mib_per_1k_tokens_ratio"] = ok[-1]["mib_per_1k_tokens"] / ok[0]["mib_per_1k_tokens"]
        entry["longest_measured"] = seqs[-1] if seqs else None
        out[name] = entry
    return out


def _num(value: Optional[float], fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def _tokens(n: int) -> str:
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def markdown(result: dict[str, Any]) -> str:
    """The table of every row, then the fitted exponents per series."""
    meta = result["meta"]
    lines = [f"# Scaling: {meta['model_text']}", "",
             f"Per-step time budget {meta['budget_s']:.0f} s, memory budget {meta['memory_budget_gib']:g} GiB per "
             f"rank; {meta['device']}. s/step: Megatron's `elapsed time per iteration` of the last step (one step "
             f"from {_tokens(meta['single_step_from'])} tokens on, two below, the second timed). Peak: the largest "
             "rank's peak resident memory. Wall: the whole run, start-up included. Planner: `megatron_longctx.plan` "
             "for the same configuration"
             + (f" + the fixed footprint measured at {_tokens(meta['calibration_length'])} tokens" if
                meta.get("calibration_length") else " (no fixed footprint: --calibration-length 0)") + ".", ""]
    for name, cal in result.get("calibration", {}).items():
        lines.append(f"- fixed footprint of {name}: {_num(cal.get('fixed_mib'), '.0f')} MiB/rank ({cal['note']})")
    if result.get("calibration"):
        lines.append("")
    lines += ["| series | tokens | s/step | µs/token | peak MiB/rank | MiB/1K tokens | above fixed, MiB/1K | "
              "planner MiB | planner/measured | loss | wall s | status |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        status = f"{r['status']}: {r['reason']}" if r.get("reason") else r["status"]
        if r.get("over_budget"):
            status += " (over the time budget)"
        ratio = r["planner_mib"] / r["peak_mib"] if r.get("planner_mib") and r.get("peak_mib") else None
        lines.append(
            f"| {r['label']} | {_tokens(r['seq_length'])} | {_num(r.get('step_s'), '.2f')} | "
            f"{_num(r.get('us_per_token'), '.1f')} | {_num(r.get('peak_mib'), '.0f')} | "
            f"{_num(r.get('mib_per_1k_tokens'), '.2f')} | {_num(r.get('above_fixed_mib_per_1k_tokens'), '.3f')} | "
            f"{_num(r.get('planner_mib'), '.0f')} | {_num(ratio, '.2f')} | {_num(r.get('loss'), '.4f')} | "
            f"{_num(r.get('wall_s'), '.0f')} | {status} |")
    lines += ["", "| series | lengths measured | time exponent | memory exponent | memory above fixed, exponent | "
              "µs/token longest/shortest | MiB/1K tokens longest/shortest |", "|---|---|---:|---:|---:|---:|---:|"]
    labels = {r["series"]: r["label"] for r in result["rows"]}
    for name, f in result["fits"].items():
        lines.append(f"| {labels.get(name, name)} | {', '.join(_tokens(s) for s in f['lengths']) or '—'} | "
                     f"{_num(f['time_exponent'], '.2f')} | {_num(f['memory_exponent'], '.2f')} | "
                     f"{_num(f['memory_above_fixed_exponent'], '.2f')} | {_num(f.get('us_per_token_ratio'), '.2f')} | "
                     f"{_num(f.get('mib_per_1k_tokens_ratio'), '.2f')} |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> Optional[str]:
    """``path``: s/step and peak MiB per rank against tokens, log-log, one line per series (the planner's
    memory dashed); ``None`` when matplotlib is not installed (``pip install 'megatron-longctx[bench]'``)."""
    plt = harness.pyplot()
    if plt is None:
        return None
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
    labels = {r["series"]: r["label"] for r in result["rows"]}
    for name in result["fits"]:
        ok = measured(result["rows"], name)
        if not ok:
            continue
        xs = [r["seq_length"] for r in ok]
        line, = ax_t.plot(xs, [r["step_s"] for r in ok], marker="o", label=labels[name])
        ax_m.plot(xs, [r["peak_mib"] for r in ok], marker="o", color=line.get_color(), label=labels[name])
        planned = [(r["seq_length"], r["planner_mib"]) for r in ok if r.get("planner_mib")]
        if planned:
            ax_m.plot(*zip(*planned), linestyle="--", marker="x", color=line.get_color(), alpha=0.7,
                      label=f"{labels[name]} (planner)")
    for ax, ylabel in ((ax_t, "s / step"), (ax_m, "peak MiB / rank")):
        harness.log_log_axes(ax, ylabel, legend_size=7)
    fig.suptitle(textwrap.fill(result["meta"]["model_text"], 150), fontsize=8)
    return harness.save_figure(fig, path)


def write_all(result: dict[str, Any], out_dir: str, plots: bool = True) -> list[str]:
    """``scaling.json``, ``scaling.md`` and (``plots``) ``scaling.png`` under ``out_dir``; the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "scaling.json"), os.path.join(out_dir, "scaling.md")]
    harness.write_json(paths[0], result)
    with open(paths[1], "w") as f:
        f.write(markdown(result))
    png = plot(result, os.path.join(out_dir, "scaling.png")) if plots else None
    return paths + ([png] if png else [])
