"""``megatron-longctx bench scaling`` (= ``python -m megatron_longctx.bench.scaling``): how one training step
grows with the sequence, through Megatron-LM's unmodified ``pretrain_gpt.py``.

One Llama-proportioned model, ``llama-h128`` (2 layers, hidden 128, 4 query heads / 2 query groups, SwiGLU ffn
352, RMSNorm, RoPE, untied embeddings, no biases, vocabulary 8,192, float32, Megatron's mock data, one sequence per
step), trained by the unmodified script under ``python -m megatron_longctx.launch`` in four series:

* ``windowed``: the plugin with a sliding window (``--window-size 2048,0``) at 16K, 64K, 256K and 1M tokens;
* ``causal``: the same without a window, at doubling lengths as far as the per-step time budget allows;

both on 2 ranks, CP=2 ring (``--cp-comm-type p2p``), Megatron's full recompute (uniform, 1 layer) with the
recomputed layers' inputs offloaded to disk (``--longctx-offload-policy checkpoint --longctx-offload-target
disk``), tiled MLP and tiled loss; and Megatron's best baseline on this machine at the same lengths:

* ``megatron-windowed`` / ``megatron-causal``: Megatron's own (local, unfused) attention with the same full
  recompute, on 1 rank at CP=1 (Megatron refuses CP without Transformer Engine), the same script under
  ``python -m megatron_longctx.megatron.cpu_compat`` (no plugin).

A series stops at the first length whose step the cost model of its measured steps (``t = c0 + c1·s``
under a window, ``+ c2·s²`` otherwise; coefficients >= 0, least squares in relative error; with fewer
steps than terms, the last step scaled by ``s^degree``, an upper bound) predicts over ``--budget-s``, whose
planner memory is over ``--memory-budget-gib``, or whose run failed; the rest of it is skipped with the
reason.  A run is killed, and its length marked as not fitting, when a process's resident memory passes
the memory budget, or after ``--startup-s`` + (steps + 1) × ``--budget-s`` seconds.

Per length: s/step (Megatron's ``elapsed time per iteration`` of the second step, or of the only one from
``--single-step-from`` on), µs/token, the largest rank's peak resident memory (``wait4``'s ``ru_maxrss``:
the kernel's high-water mark), MiB per 1K tokens, and the planner's memory for the same configuration
(:func:`megatron_longctx.plan.memory.memory_breakdown`, float32, no GPU reserve) plus the fixed footprint
of the processes (Python, torch, Megatron, gloo), measured once per kind of job at
``--calibration-length`` tokens as its peak less the planner's bytes there.  Then the growth exponents of
time and memory per series (least squares on log-log) and ``scaling.json``, ``scaling.md``,
``scaling.png`` under ``--output-dir``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_longctx.bench import harness
from megatron_longctx.bench import scaling_report as report
from megatron_longctx.megatron import lm_scripts
from megatron_longctx.plan.flags import model_flags
from megatron_longctx.plan.model import ModelShape

MIB, GIB = 2**20, 2**30
MLP_TILE_TOKENS = 4096  # tokens per rank in one tiled-MLP tile: [4096, 2 x 352] float32 = 11 MiB
LOSS_TILE_TOKENS = 2048  # ... in one tiled-loss tile: [2048, 8192] float32 logits = 64 MiB
RECOMPUTE = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")


# The benchmarked models, in the planner's shape type (vocabularies already multiples of Megatron's 128).
MODELS = {
    "llama-h128": ModelShape(name="llama-h128", num_layers=2, hidden_size=128, num_attention_heads=4,
                             num_query_groups=2, kv_channels=32, ffn_hidden_size=352, vocab_size=8192),
    "tiny-h32": ModelShape(name="tiny-h32", num_layers=1, hidden_size=32, num_attention_heads=2, num_query_groups=1,
                       kv_channels=16, ffn_hidden_size=64, vocab_size=256),  # tests: seconds per run
}


def model_text(m: ModelShape) -> str:
    return (f"{m.name}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads / "
            f"{m.num_query_groups} query groups (head dim {m.kv_channels}), SwiGLU ffn {m.ffn_hidden_size}, "
            f"RMSNorm, RoPE, untied embeddings, no bias, vocabulary {m.vocab_size}; float32, mock data, "
            "1 sequence per step")


@dataclasses.dataclass(frozen=True)
class Series:
    """One line of the benchmark: who attends (the plugin or Megatron), with or without the window."""

    name: str
    plugin: bool  # the plugin at CP=2 on 2 ranks, or Megatron's own attention at CP=1 on 1 rank
    windowed: bool
    degree: int  # how the step time grows with the sequence: 1 (the plugin's window), 2 (anything dense)

    @property
    def nproc(self) -> int:
        return 2 if self.plugin else 1

    @property
    def kind(self) -> str:
        """Jobs of one kind share a fixed footprint (the calibration)."""
        return "plugin" if self.plugin else "megatron"

    def label(self, window: tuple[int, int]) -> str:
        what = f"window {window[0]},{window[1]}" if self.windowed else "full causal"
        if self.plugin:
            return f"plugin, {what} (CP=2 ring, 2 ranks)"
        return f"Megatron local attention, {what} (CP=1, 1 rank)"


SERIES = {s.name: s for s in (
    Series("windowed", plugin=True, windowed=True, degree=1),
    Series("causal", plugin=True, windowed=False, degree=2),
    Series("megatron-windowed", plugin=False, windowed=True, degree=2),
    Series("megatron-causal", plugin=False, windowed=False, degree=2),
)}


# ----------------------------------------------------------------------------------------- arguments
def _token_list(flag: str) -> Callable[[str], list[int]]:
    """A parser of ``16K,64K,1M`` (integers, or with K/M) whose errors name ``flag``."""
    from megatron_longctx.plan.model import parse_tokens

    def parse(text: str) -> list[int]:
        try:
            values = [parse_tokens(t) for t in text.split(",") if t.strip()]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: give comma-separated token counts, e.g. 16K,64K,1M")
        return sorted(set(values))
    return parse


def _token_count(text: str) -> int:
    values = _token_list("--single-step-from")(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"--single-step-from {text!r}: give one token count, e.g. 1M")
    return values[0]


def _window(text: str) -> tuple[int, int]:
    try:
        left, right = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window {text!r}: give LEFT,RIGHT tokens, e.g. 2048,0") from None
    if left < 1 or right != 0:
        raise argparse.ArgumentTypeError(f"--window {text!r}: a causal window is LEFT,0 with LEFT >= 1, e.g. 2048,0")
    return left, right


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-longctx bench scaling", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--lengths", type=_token_list("--lengths"), default="16K,64K,256K,1M",
                   help="sequence lengths of the windowed series (and of the Megatron baseline with the window)")
    p.add_argument("--causal-lengths", type=_token_list("--causal-lengths"),
                   default="4K,8K,16K,32K,64K,128K,256K,512K,1M",
                   help="lengths of the full-causal series, in order, as far as the budget allows")
    p.add_argument("--window", type=_window, default="2048,0", help="--window-size of the windowed series")
    p.add_argument("--series", default=",".join(SERIES),
                   help=f"comma-separated series to run, of: {', '.join(SERIES)}")
    p.add_argument("--budget-s", type=float, default=600.0,
                   help="per-step time budget: a series stops where its next step is predicted to take longer")
    p.add_argument("--memory-budget-gib", type=float, default=8.0,
                   help="per-rank memory budget: lengths the planner puts over it are skipped, and a run is killed "
                        "when a process's resident memory passes it")
    p.add_argument("--single-step-from", type=_token_count, default="1M",
                   help="from this length on one step is run and timed (below: two, the second timed)")
    p.add_argument("--calibration-length", type=int, default=2048,
                   help="tokens of the short run per kind of job (plugin, Megatron) that measures the fixed footprint "
                        "added to the planner's memory; 0: none (the planner's bytes alone)")
    p.add_argument("--startup-s", type=float, default=900.0,
                   help="seconds a run may take besides its steps (start-up, dataset) before it is killed")
    p.add_argument("--model", choices=sorted(MODELS), default="llama-h128",
                   help="llama-h128: the Llama-proportioned model above; tiny: 1 layer, hidden 32 (tests)")
    p.add_argument("--output-dir", default="runs/scaling")
    p.add_argument("--megatron-lm-dir", default=None,
                   help=f"folder with Megatron-LM's pretrain_gpt.py (default: ${lm_scripts.SCRIPTS_ENV}, then "
                        f"{lm_scripts.default_scripts_folder()})")
    p.add_argument("--dry-run", action="store_true",
                   help="print and write the planned runs (flags, planner memory) without running any")
    p.add_argument("--no-plots", action="store_true")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    names = [n.strip() for n in args.series.split(",") if n.strip()]
    unknown = [n for n in names if n not in SERIES]
    if unknown or not names:
        parser.error(f"--series {args.series!r}: choose from {', '.join(SERIES)}")
    args.series_list = [SERIES[n] for n in names]
    for flag in ("budget_s", "memory_budget_gib", "startup_s"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)!r}: give a number > 0")
    if args.calibration_length < 0 or args.calibration_length % 4:
        parser.error(f"--calibration-length {args.calibration_length}: give a multiple of 4 (2·CP), or 0 for none")
    for flag in ("lengths", "causal_lengths"):
        odd = [s for s in getattr(args, flag) if s % 4]
        if odd:
            parser.error(f"--{flag.replace('_', '-')}: {odd[0]} tokens cannot be split by CP=2 into 2·CP chunks; "
                         "give multiples of 4")


# --------------------------------------------------------------------------------------- one run
def tiles(seq: int, cp: int = 2) -> tuple[int, int]:
    """(tiled-MLP tiles, tiled-loss tiles) at ``seq`` tokens: at most :data:`MLP_TILE_TOKENS` /
    :data:`LOSS_TILE_TOKENS` tokens of a rank per tile, and at least 2."""
    per_rank = seq // cp
    return max(2, -(-per_rank // MLP_TILE_TOKENS)), max(2, -(-per_rank // LOSS_TILE_TOKENS))


def script_args(model: ModelShape, series: Series, seq: int, window: tuple[int, int], steps: int) -> list[str]:
    """``pretrain_gpt.py``'s arguments for one run (the model's flags as the planner prints them)."""
    args = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(model.vocab_size),
            *model_flags(model), "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4", "--train-iters", str(steps),
            "--eval-iters", "0", "--log-interval", "1",
            "--seed", "1234", "--no-create-attention-mask-in-dataloader", *RECOMPUTE]
    if series.windowed:
        args += ["--window-size", f"{window[0]},{window[1]}"]
    if series.plugin:
        mlp, loss = tiles(seq)
        args += ["--context-parallel-size", "2", "--cp-comm-type", "p2p",
                 "--longctx-offload-policy", "checkpoint", "--longctx-offload-target", "disk",
                 "--longctx-tiled-mlp-tiles", str(mlp), "--longctx-tiled-loss-tiles", str(loss)]
    return args


def planner_bytes(model: ModelShape, series: Series, seq: int) -> float:
    """The planner's peak bytes per rank for the run's configuration (float32, no GPU reserve)."""
    from megatron_longctx.plan.memory import memory_breakdown
    from megatron_longctx.plan.model import MemoryOptions, Parallel

    mlp, loss = tiles(seq) if series.plugin else (1, 1)
    opt = MemoryOptions(attention_impl="flash" if series.plugin else "local", recompute="full",
                        offload="checkpoint" if series.plugin else "none", tiled_mlp_tiles=mlp, tiled_loss_tiles=loss,
                        bytes_per_element=4, fused_swiglu=False, fused_rope=False, sequence_parallel=False)
    par = Parallel(cp=series.nproc, cp_comm_type="p2p")
    return memory_breakdown(model, seq, par, opt, reserved_gib=0.0).peak


@dataclasses.dataclass(frozen=True)
class RunLimits:
    timeout_s: float
    rss_limit_bytes: int


Runner = Callable[[Series, list[str], RunLimits], lm_scripts.ScriptRun]


def script_runner(script: Path) -> Runner:
    """Runs ``script`` under the launcher (plugin series) or ``cpu_compat`` (Megatron's own attention), with
    ``OMP_NUM_THREADS`` = cores / ranks unless it is set."""
    def run(series: Series, args: list[str], limits: RunLimits) -> lm_scripts.ScriptRun:
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // series.nproc))
        launcher = lm_scripts.LAUNCHER if series.plugin else lm_scripts.BASELINE_LAUNCHER
        return lm_scripts.run_script(script, args, nproc=series.nproc, launcher=launcher,
                                     env={"OMP_NUM_THREADS": threads, "PYTHONWARNINGS": "ignore"},
                                     timeout=limits.timeout_s, rss_limit_bytes=limits.rss_limit_bytes)
    return run


_EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception|Exit)\b.*)")


def _tail(output: str) -> str:
    """The rank's exception line (not torchrun's ``ChildFailedError`` about it), or the last lines."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [m.group(1) for m in map(_EXCEPTION.match, lines) if m and "ChildFailedError" not in m.group(1)]
    return (errors[-1] if errors else " / ".join(lines[-2:]))[-300:]


def measure(row: dict[str, Any], run: lm_scripts.ScriptRun, fixed_mib: Optional[float]) -> dict[str, Any]:
    """Fill ``row`` from a finished run: status, timed step, memory, loss, and with the fixed footprint
    ``fixed_mib`` the memory above it (in place; returned)."""
    seq = row["seq_length"]
    times = run.iteration_times_s()
    row.update(wall_s=round(run.wall_s, 2), returncode=run.returncode, peak_mib=run.peak_rss_bytes / MIB,
               rank_peaks_mib_sampled=[b / MIB for b in run.rank_peaks_bytes()],
               iteration_s={str(k): v for k, v in sorted(times.items())})
    if run.over_memory:  # tried, and it does not fit
        row.update(status="skipped", reason=f"does not fit: a process passed the {row['memory_budget_gib']:g} GiB "
                                            f"memory budget (killed after {run.wall_s:.0f} s)")
    elif run.timed_out:
        row.update(status="skipped", reason=f"does not fit: killed after {run.wall_s:.0f} s (start-up + (steps + 1) "
                                            "x the time budget)")
    elif run.returncode != 0 or not times:
        row.update(status="failed", reason=f"exit code {run.returncode}: {_tail(run.output)}")
    if row.get("status"):
        return row
    timed = max(times)
    step_s = times[timed]
    losses = run.lm_losses()
    row.update(status="ok", timed_iteration=timed, step_s=step_s, us_per_token=step_s / seq * 1e6,
               mib_per_1k_tokens=row["peak_mib"] / (seq / 1024), loss=losses[-1] if losses else None)
    if fixed_mib is not None:
        above = row["peak_mib"] - fixed_mib
        row.update(fixed_mib=fixed_mib, above_fixed_mib=above, above_fixed_mib_per_1k_tokens=above / (seq / 1024))
    return row


# ------------------------------------------------------------------------------------- the budget
def predict_step_s(points: Sequence[tuple[int, float]], seq: int, degree: int) -> Optional[float]:
    """Seconds of a step at ``seq`` tokens from the series' measured ``(tokens, s/step)``: the cost model
    ``t = Σ_{k=0..degree} c_k·s^k`` with every ``c_k >= 0`` fitted by least squares in relative error; with
    fewer points than terms, the longest point scaled by ``(seq / s)^degree`` (an upper bound of that
    model).  ``None`` without points."""
    import numpy as np

    if not points:
        return None
    powers = list(range(degree + 1))
    if len(points) < len(powers):
        s_last, t_last = max(points)
        return t_last * (seq / s_last) ** degree
    ref = max(s for s, _ in points)
    x = np.array([s / ref for s, _ in points], dtype=np.float64)
    t = np.array([t for _, t in points], dtype=np.float64)
    best: Optional[tuple[float, dict[int, float]]] = None
    for size in range(1, len(powers) + 1):  # non-negative least squares by its active sets (<= 7 of them)
        for subset in itertools.combinations(powers, size):
            a = np.stack([x**k / t for k in subset], axis=1)  # rows divided by t: relative residuals
            coef, *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
            if (coef < 0).any():
                continue
            residual = float(np.sum((a @ coef - 1.0) ** 2))
            if best is None or residual < best[0] - 1e-12:
                best = (residual, dict(zip(subset, coef.tolist())))
    assert best is not None  # a single power always has a non-negative fit (positive times)
    return sum(c * (seq / ref) ** k for k, c in best[1].items())


@dataclasses.dataclass(frozen=True)
class SweepSettings:
    """What every series of one sweep shares: the model, the window and the budgets."""
    model: ModelShape
    window: tuple[int, int]
    budget_s: float
    memory_budget_gib: float
    single_step_from: int
    startup_s: float


def run_series(series: Series, lengths: Sequence[int], sweep: SweepSettings, *, fixed_mib: Optional[float],
               runner: Optional[Runner], log: Callable[[str], None] = print,
               on_row: Callable[[dict[str, Any]], None] = lambda row: None) -> list[dict[str, Any]]:
    """The rows of one series, shortest first, each given to ``on_row`` once final; ``runner=None``: planned
    only (``--dry-run``)."""
    model, window, budget_s = sweep.model, sweep.window, sweep.budget_s
    memory_budget_gib, single_step_from, startup_s = sweep.memory_budget_gib, sweep.single_step_from, sweep.startup_s
    rows: list[dict[str, Any]] = []
    points: list[tuple[int, float]] = []
    stopped: Optional[str] = None
    label = series.label(window)
    for seq in sorted(lengths):
        steps = 1 if seq >= single_step_from else 2
        args = script_args(model, series, seq, window, steps)
        planned = planner_bytes(model, series, seq) / MIB
        row: dict[str, Any] = dict(series=series.name, label=label, seq_length=seq, nproc=series.nproc,
                                   steps=steps, planner_bytes_mib=planned, memory_budget_gib=memory_budget_gib,
                                   script_args=args)
        rows.append(row)
        predicted_mib = row["planner_mib"] = planned + (fixed_mib or 0.0)
        predicted_s = predict_step_s(points, seq, series.degree)
        row["predicted_step_s"] = predicted_s
        if stopped is not None:
            row.update(status="skipped", reason=stopped)
        elif series.windowed and window[0] >= seq:
            row.update(status="skipped", reason=f"the window ({window[0]}) is not shorter than the sequence")
        elif predicted_mib > memory_budget_gib * 1024:
            row.update(status="skipped", reason=f"planner: {predicted_mib / 1024:.1f} GiB per rank > the "
                                                f"{memory_budget_gib:g} GiB budget")
            stopped = f"a shorter length was over the memory budget ({row['seq_length']} tokens)"
        elif predicted_s is not None and predicted_s > budget_s:
            row.update(status="skipped", reason=f"predicted {predicted_s:.0f} s/step > the {budget_s:.0f} s budget")
            stopped = f"a shorter length was predicted over the time budget ({seq} tokens)"
        elif runner is None:
            row.update(status="planned")
        if row.get("status"):
            on_row(row)
            continue
        log(f"[scaling] {series.name} at {seq} tokens ({steps} step{'s' if steps > 1 else ''}"
            + (f", predicted {predicted_s:.1f} s/step" if predicted_s is not None else "") + ") ...")
        limits = RunLimits(timeout_s=startup_s + (steps + 1) * budget_s, rss_limit_bytes=int(memory_budget_gib * GIB))
        measure(row, runner(series, args, limits), fixed_mib)
        on_row(row)
        if row["status"] != "ok":
            log(f"[scaling]   {row['status']}: {row['reason']}")
            stopped = f"the run at {seq} tokens " + ("did not fit" if row["status"] == "skipped" else "failed")
            continue
        log(f"[scaling]   {row['step_s']:.2f} s/step, peak {row['peak_mib']:.0f} MiB/rank (planner "
            f"{row['planner_mib']:.0f}), wall {row['wall_s']:.0f} s")
        points.append((seq, row["step_s"]))
        if row["step_s"] > budget_s:
            row["over_budget"] = True
            stopped = f"the step at {seq} tokens took longer than the {budget_s:.0f} s budget"
    return rows


def calibrate(series: Series, seq: int, *, model: ModelShape, runner: Runner, memory_budget_gib: float,
              startup_s: float, budget_s: float, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The fixed footprint of ``series``' kind of job: its peak at ``seq`` tokens (full causal, two steps)
    less the planner's bytes there."""
    causal = dataclasses.replace(series, windowed=False)
    args = script_args(model, causal, seq, (1, 0), 2)
    log(f"[scaling] calibration of {series.kind} jobs at {seq} tokens ...")
    run = runner(causal, args, RunLimits(startup_s + 3 * budget_s, int(memory_budget_gib * GIB)))
    planned = planner_bytes(model, causal, seq) / MIB
    entry: dict[str, Any] = dict(seq_length=seq, planner_bytes_mib=planned, peak_mib=run.peak_rss_bytes / MIB,
                                 returncode=run.returncode, script_args=args)
    if run.returncode != 0 or run.timed_out or run.over_memory:
        entry.update(fixed_mib=None, note=f"calibration failed ({_tail(run.output)}); planner bytes alone")
    else:
        entry.update(fixed_mib=entry["peak_mib"] - planned,
                     note=f"peak {entry['peak_mib']:.0f} MiB at {seq} tokens less the planner's {planned:.0f} MiB")
    log(f"[scaling]   fixed footprint: {entry['note']}")
    return entry


# ------------------------------------------------------------------------------------------- driver
def run(args: argparse.Namespace, runner: Optional[Runner] = None,
        on_update: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    """Every series of ``args``; the result dict (meta, calibration, rows, fits), also given to ``on_update``
    after each row.  ``runner``: how a run is made (default: Megatron-LM's script copied under
    ``--output-dir``; ``--dry-run``: none)."""
    model = MODELS[args.model]
    if runner is None and not args.dry_run:
        if args.megatron_lm_dir:
            os.environ[lm_scripts.SCRIPTS_ENV] = args.megatron_lm_dir
        runner = script_runner(lm_scripts.copy_scripts(Path(args.output_dir) / "megatron_lm"))
    if args.dry_run:
        runner = None
    limits = dict(memory_budget_gib=args.memory_budget_gib, startup_s=args.startup_s, budget_s=args.budget_s)
    calibration: dict[str, dict[str, Any]] = {}
    if runner is not None and args.calibration_length:
        for series in args.series_list:
            if series.kind not in calibration:
                calibration[series.kind] = calibrate(series, args.calibration_length, model=model, runner=runner,
                                                     **limits)
    meta = harness.environment(
        model=dataclasses.asdict(model), model_text=model_text(model), window=list(args.window),
        budget_s=args.budget_s, memory_budget_gib=args.memory_budget_gib, single_step_from=args.single_step_from,
        calibration_length=args.calibration_length, device=f"CPU ({os.cpu_count()} cores, {platform.machine()}), gloo",
        omp_num_threads=os.environ.get("OMP_NUM_THREADS") or "cores / ranks",
        command=["megatron-longctx", "bench", "scaling", *getattr(args, "argv", [])], dry_run=bool(args.dry_run))
    names = [s.name for s in args.series_list]
    result: dict[str, Any] = dict(schema=report.SCHEMA, meta=meta, calibration=calibration, rows=[], fits={})

    def add(row: dict[str, Any]) -> None:
        result["rows"].append(row)
        result["fits"] = report.fits(result["rows"], names)
        on_update(result)

    for series in args.series_list:
        cal = calibration.get(series.kind, {})
        sweep = SweepSettings(model=model, window=args.window, single_step_from=args.single_step_from, **limits)
        run_series(series, args.lengths if series.windowed else args.causal_lengths, sweep,
                   fixed_mib=cal.get("fixed_mib"), runner=runner, on_row=add)
    result["fits"] = report.fits(result["rows"], names)
    return result


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    check_args(parser, args)
    args.argv = argv
    try:  # the JSON and the table are rewritten after every row: an interrupted run keeps what it measured
        result = run(args, on_update=lambda partial: report.write_all(partial, args.output_dir, plots=False))
    except FileNotFoundError as exc:  # Megatron-LM's scripts are not here
        print(f"megatron-longctx bench scaling: {exc} (or pass --megatron-lm-dir)", file=sys.stderr)
        return 2
    paths = report.write_all(result, args.output_dir, plots=not args.no_plots)
    print(report.markdown(result))
    print("wrote " + ", ".join(paths))
    return 0


__all__ = ["MODELS", "SERIES", "build_parser", "main", "planner_bytes", "predict_step_s", "run", "run_series",
           "script_args", "SweepSettings"]

if __name__ == "__main__":
    sys.exit(main())
