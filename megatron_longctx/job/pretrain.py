"""The main job: long-context GPT training with Megatron-LM's own training loop and the plugin's CP.

``megatron-longctx run`` (``make run``) with no arguments trains a small GPT (2 layers, hidden 64) on
8K-token sequences of Python's own standard-library sources, byte-level tokens, with
ContextParallelAttention at CP=2 on 2 ranks (gloo on CPU, NCCL and the GPU kernels on GPUs), through
``megatron.training.pretrain`` with this package's providers (:mod:`megatron_longctx.job.providers`):
checkpoints (``--save/--load/--save-interval``, iteration folders and the tracker file), logging, NaN
checks and timeouts are Megatron's (``--mix-short`` mixes short-sequence steps in:
:mod:`megatron_longctx.job.mix`).  Three phases, each one ``torchrun``:

1. the plugin run (a checkpoint every ``--save-interval`` steps, half-way by default, and a final one);
2. the resume check: a fresh job loads the mid-run checkpoint and must reproduce the next
   ``--resume-check-steps`` losses, grad norms and learning rates bit for bit (weights, Adam moments and
   step, LR schedule and data position all come from the checkpoint);
3. baseline Megatron (its own local attention at CP=1, which refuses CP>1 without Transformer Engine) on
   the same global batches from the same initialisation; loss curves and memory per rank compared.

Every flag not listed under ``--help`` is Megatron-LM's (``--num-layers``, ``--lr``, ``--save``,
``--distributed-timeout-minutes`` ...) or the plugin's (``--longctx-*``) and goes to Megatron's parser
after the main job's defaults, so it overrides them.  Checkpoints are never deleted or overwritten unless
``--overwrite-checkpoint`` is given, and every checkpoint is checked against its manifest before a load
(:mod:`megatron_longctx.job.checkpoint_guard`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from typing import Any, Optional

from megatron_longctx.job import checkpoint_guard as guard
from megatron_longctx.job import command_line, continuation
from megatron_longctx.job import mix as mix_mod
from megatron_longctx.job.spawn import Interrupted, run_phase
from megatron_longctx.job.report import compare_losses, render_summary, run_summary

EXIT_BAD_ARGS = 2


def build_parser() -> argparse.ArgumentParser:
    p, g = command_line.job_parser("megatron-longctx run", __doc__, "Any other flag is Megatron-LM's (e.g. "
                                   "--num-layers, --lr, --save, --distributed-timeout-minutes) or a --longctx-* flag "
                                   "of the plugin.", "the main job", "runs/main",
                                   "metrics.jsonl, summary.json and checkpoint/ go here")
    g.add_argument("--overwrite-checkpoint", action="store_true",
                   help="replace a checkpoint already in --save (otherwise the run refuses to start)")
    g.add_argument("--resume-check-steps", type=int, default=3, help="steps the resume check must reproduce")
    g.add_argument("--no-resume-check", action="store_true", help="skip reloading the checkpoint to check resume")
    g.add_argument("--no-baseline", action="store_true", help="skip the baseline Megatron comparison run")
    g.add_argument("--baseline-steps", type=int, default=8,
                   help="steps of the baseline comparison run (its attention is quadratic in memory and time)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (Megatron's log lines only)")
    g.add_argument("--mix-short", default=None, metavar="SHORT:FRACTION",
                   help="train FRACTION of the steps, spread evenly, on SHORT-token sequences (e.g. 4K:0.5 alternates "
                        "--seq-length and 4,096-token batches)")
    return p


def entry_args(who: str, parser: argparse.ArgumentParser,
               argv: Optional[list[str]]) -> Optional[tuple[argparse.Namespace, list[str]]]:
    """``megatron-longctx <who>``'s own flags and the Megatron flags it passes on, or None after saying on
    stderr why Megatron's training loop cannot run here."""
    own, megatron_argv = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    reason = megatron_training_available()
    if reason is not None:
        print(f"megatron-longctx {who}: {reason}", file=sys.stderr)
        return None
    return own, megatron_argv


def megatron_training_available() -> Optional[str]:
    """``None`` when ``megatron.training`` can run the job, else the reason it cannot (imports nothing heavy)."""
    import importlib.metadata

    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if importlib.util.find_spec("megatron") is None:
        return "megatron-core is not installed: pip install 'megatron-core>=0.19'"
    if importlib.util.find_spec("megatron.training") is None:
        return (f"the main job runs Megatron-LM's training loop (megatron.training), which the megatron-core "
                f"{version or '(unknown version)'} install does not ship: install megatron-core >= 0.19 (the "
                "pinned 0.19.2: pip install -c constraints.txt megatron-core), or run Megatron-LM's own "
                "pretrain_gpt.py from a checkout with python -m megatron_longctx.launch")
    return None


def _prepare_checkpoints(job: command_line.Job, own: argparse.Namespace) -> list[str]:
    """Refuse to clobber an existing checkpoint; verify the one to load.  Returns notes for the user."""
    notes: list[str] = []
    if job.load is not None:
        job.load_step, notes = continuation.resolve_source(job.load, job.ckpt_step)
        continuation.check_continuation(job.load, job.load_step, job.save, [*command_line.DEFAULTS, *job.user_argv])
        if job.save is not None and os.path.abspath(job.save) == os.path.abspath(job.load):
            notes += guard.set_aside_later(job.save, job.load_step)  # the resumed saves must not overwrite them
    same_dir = job.load is not None and job.save is not None and os.path.abspath(job.save) == os.path.abspath(job.load)
    if job.save is not None and not same_dir:
        existing = guard.existing_checkpoint(job.save)
        if existing and not own.overwrite_checkpoint:
            raise guard.CheckpointError(
                f"{existing}; this run would overwrite it. Resume it with --load {job.save}, keep it and choose "
                f"another --output-dir (or --save), or pass --overwrite-checkpoint to replace it")
        if existing:
            shutil.rmtree(job.save)
            notes.append(f"--overwrite-checkpoint: removed the earlier checkpoint in {job.save}")
    return notes


def _read_rows(path: str, name: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    return [r for r in map(json.loads, open(path)) if r["run"] == name]


def _phase(job: command_line.Job, own: argparse.Namespace, name: str, argv: list[str], total: int,
           baseline: bool = False) -> list[dict[str, Any]]:
    metrics = os.path.join(own.output_dir, "metrics.jsonl")
    settings = {"name": name, "metrics": os.path.abspath(metrics), "progress": not own.no_progress,
                "total_steps": total}
    if own.mix_short is not None:  # every phase trains on the same mixed batches
        mix = mix_mod.parse(own.mix_short)
        settings["mix_short"] = [mix.short, mix.fraction]
    env = {"LONGCTX_BASELINE": "1"} if baseline else {"LONGCTX_BASELINE": "0"}
    rc, reports = run_phase(argv, own.nproc_per_node, settings, env)
    if rc != 0:
        detail = "".join(f"\n  {r.strip().splitlines()[-1]}" for r in reports if r.strip())
        what = f"{len(reports)} rank(s) failed, every rank stopped" if reports else f"torchrun exited {rc}"
        raise PhaseFailed(f"{name}: {what}{detail}", rc)
    return _read_rows(metrics, name)


class PhaseFailed(RuntimeError):
    def __init__(self, message: str, rc: int) -> None:
        super().__init__(message)
        self.rc = rc


def _resume_check(job: command_line.Job, own: argparse.Namespace, plugin_rows: list[dict[str, Any]]) -> Optional[dict]:
    """Reload the mid-run checkpoint in a fresh job and compare the next steps bit for bit."""
    step = job.resume_point(own.resume_check_steps)
    if step is None:
        return None
    loaded, _ = guard.resolve_load(job.save, step)
    stop = loaded + own.resume_check_steps
    rows = _phase(job, own, "resume", job.resume_argv(loaded, stop), stop)
    original = {r["step"]: r for r in plugin_rows}
    pairs = [(r, original[r["step"]]) for r in rows if r["step"] in original]
    keys = ("loss", "grad_norm", "lr")
    ok = len(pairs) == own.resume_check_steps and all(a[k] == b[k] for a, b in pairs for k in keys)
    diff = max((abs(a["loss"] - b["loss"]) for a, b in pairs), default=float("nan"))
    result = {"checkpoint": guard.iteration_dir(job.save, loaded), "loaded_step": loaded,
              "steps": [r["step"] for r, _ in pairs], "resumed_loss": [r["loss"] for r, _ in pairs],
              "uninterrupted_loss": [b["loss"] for _, b in pairs], "max_abs_diff": diff, "ok": ok}
    print(f"[resume] reloaded iteration {loaded}; steps {loaded + 1}..{stop}: "
          f"{'identical' if ok else 'MISMATCH'} (loss, grad norm, lr; max |loss diff| {diff:.2e})", flush=True)
    return result


def checked_job(own: argparse.Namespace, megatron_argv: list[str]) -> tuple[command_line.Job, Optional[mix_mod.Mix]]:
    """The job and its mix of short batches, checked as the run checks them before any rank starts
    (``ValueError`` naming the flag): what ``extend`` asks of every stage before the first one runs."""
    job = command_line.Job.from_argv(megatron_argv, own)
    mix = None if own.mix_short is None else mix_mod.parse(own.mix_short)
    mix_mod.check(mix, job.values.seq_length, job.context_parallel_size)
    return job, mix


def run_job(own: argparse.Namespace, megatron_argv: list[str]) -> int:
    job, mix = checked_job(own, megatron_argv)
    os.makedirs(own.output_dir, exist_ok=True)
    for note in _prepare_checkpoints(job, own):
        print(f"megatron-longctx run: {note}", flush=True)
    metrics = os.path.join(own.output_dir, "metrics.jsonl")
    if os.path.exists(metrics) and job.load is None:
        os.remove(metrics)  # a fresh run's metrics (a resumed run appends)
    job.data_path = command_line.ensure_corpus(own, job.values.seq_length)
    summary: dict[str, Any] = {"world_size": own.nproc_per_node, "shape": job.shape(), "train_steps": job.train_iters,
                               "mix_short": None if mix is None else dataclasses.asdict(mix),
                               "global_batch_size": job.global_batch_size, "device": command_line.device_name(),
                               "checkpoint": job.save}
    name = f"plugin-cp{job.context_parallel_size}"
    rows = _phase(job, own, name, job.plugin_argv(), job.train_iters)
    summary["plugin"] = {"variant": {"name": name, "context_parallel_size": job.context_parallel_size,
                                     "plugin": True, "longctx": job.longctx_flags()}, **run_summary(rows)}
    summary["saved_iterations"] = guard.saved_iterations(job.save) if job.save else []
    if not own.no_resume_check and job.save:
        resume = _resume_check(job, own, rows)
        if resume is not None:
            summary["resume"] = resume
    if not own.no_baseline:
        steps = min(own.baseline_steps, job.train_iters)
        base = _phase(job, own, "baseline-cp1", job.baseline_argv(steps), steps, baseline=True)
        summary["baseline"] = {"variant": {"name": "baseline-cp1", "context_parallel_size": 1, "plugin": False},
                               **run_summary(base)}
        summary["comparison"] = compare_losses(rows, base)
    with open(os.path.join(own.output_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(render_summary(summary), flush=True)
    ok = summary.get("resume", {}).get("ok", True) and summary.get("comparison", {}).get("losses_agree", True)
    return 0 if ok else 1


def main(argv: Optional[list[str]] = None) -> int:
    parsed = entry_args("run", build_parser(), argv)
    if parsed is None:
        return EXIT_BAD_ARGS
    own, megatron_argv = parsed
    start = time.perf_counter()
    try:
        rc = run_job(own, megatron_argv)
    except (ValueError, guard.CheckpointError) as exc:
        print(f"megatron-longctx run: error: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    except PhaseFailed as exc:
        print(f"megatron-longctx run: {exc}", file=sys.stderr)
        rc = exc.rc
    except Interrupted as exc:
        print(f"megatron-longctx run: {exc}; every rank has been stopped", file=sys.stderr)
        return 128 + exc.signum
    print(f"megatron-longctx run: exit {rc} after {time.perf_counter() - start:.0f} s; metrics in "
          f"{os.path.join(own.output_dir, 'metrics.jsonl')}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
