"""``megatron-longctx eval``: a checkpoint evaluated at length, forward only, under the plugin's CP.

    megatron-longctx eval --load CKPT --seq-length L [--context-parallel-size C] [--longctx-*] [Megatron flags]

From a checkpoint (the main job's, or one Megatron-LM wrote), the model is built and loaded as the main
job builds it (the same providers, Megatron's own loader, the memory features), then instead of training,
on every rank:

* **position loss**: ``--eval-batches`` global batches of the corpus at ``--seq-length``, per-token loss
  summed per position and reduced over every rank (CP ranks hold disjoint positions of the zigzag layout,
  data-parallel ranks other samples), reported in ``--position-bins`` equal bins (the long-context curve);
* **passkey**: for each length in ``--passkey-lengths`` and depth in ``--passkey-depths``,
  ``--passkey-trials`` prompts (:mod:`megatron_longctx.job.passkey`); a prompt counts as retrieved when the
  argmax before each answer token is that token.

``OUTPUT_DIR/eval.json`` (keys ``position_loss`` and ``passkey``), a printed table, and
``position_loss.png`` (curve) and ``passkey.png`` (length x depth heatmap).  ``--megatron-attention``
evaluates with Megatron's own attention instead (CP=1), for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Optional

from megatron_longctx.job import command_line, continuation
from megatron_longctx.job.spawn import Interrupted, run_phase

EXIT_BAD_ARGS = 2


def build_parser() -> argparse.ArgumentParser:
    p, g = command_line.job_parser("megatron-longctx eval", __doc__, "Any other flag is Megatron-LM's (--seq-length, "
                                   "--context-parallel-size, the model's shape, --rotary-base ...) or a --longctx-* "
                                   "flag of the plugin.", "evaluation", "runs/eval", "eval.json and the plots go here")
    g.add_argument("--load", required=True, help="the checkpoint directory (Megatron's layout: iter_* folders)")
    g.add_argument("--ckpt-step", type=int, default=None, help="the iteration to load (default: the tracker's)")
    g.add_argument("--eval-batches", type=int, default=2, help="global batches of the corpus for the position loss")
    g.add_argument("--position-bins", type=int, default=16, help="equal position bins of the loss curve")
    g.add_argument("--passkey-lengths", default=None, help="comma-separated prompt lengths (default: --seq-length)")
    g.add_argument("--passkey-depths", default="0,0.25,0.5,0.75,1", help="comma-separated needle depths in [0, 1]")
    g.add_argument("--passkey-trials", type=int, default=2, help="prompts (keys) per length and depth")
    g.add_argument("--megatron-attention", action="store_true",
                   help="Megatron's own attention (CP=1) instead of the plugin's, for comparison")
    g.add_argument("--no-progress", action="store_true", help="(accepted for symmetry with run)")
    return p


def _numbers(text: str, kind: type, flag: str) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected comma-separated numbers, e.g. {flag} 1024,4096") from None


def plan(own: argparse.Namespace, megatron_argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The worker's Megatron command line and the evaluation settings, checked before any rank starts."""
    for flag, value in (("--eval-batches", own.eval_batches), ("--position-bins", own.position_bins),
                        ("--passkey-trials", own.passkey_trials)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be >= 1")
    own.resume_check_steps, own.baseline_steps = 1, 1  # what command_line.Job reads of run's own flags
    argv = list(megatron_argv)
    if own.megatron_attention:
        argv += ["--context-parallel-size", "1"]
    job = command_line.Job.from_argv([*argv, "--train-iters", str(own.eval_batches), "--lr-warmup-iters", "0"], own)
    seq, cp = job.values.seq_length, job.context_parallel_size
    lengths = _numbers(own.passkey_lengths, int, "--passkey-lengths") if own.passkey_lengths else [seq]
    depths = _numbers(own.passkey_depths, float, "--passkey-depths")
    for length in lengths:
        if length > seq or length % (2 * cp):
            raise ValueError(f"--passkey-lengths {length}: each length must be at most --seq-length {seq} and a "
                             f"multiple of 2 x --context-parallel-size ({2 * cp})")
    for depth in depths:
        if not 0 <= depth <= 1:
            raise ValueError(f"--passkey-depths {depth}: a depth is a fraction in [0, 1]")
    if own.position_bins > seq:
        raise ValueError(f"--position-bins {own.position_bins}: at most --seq-length {seq}")
    step, notes = continuation.resolve_source(own.load, own.ckpt_step)
    continuation.check_continuation(own.load, step, None, [*command_line.DEFAULTS, *job.user_argv])
    for note in notes:
        print(f"megatron-longctx eval: {note}", flush=True)
    job.data_path = command_line.ensure_corpus(own, job.values.seq_length)
    worker_argv = [*job._common(), "--load", own.load, "--ckpt-step", str(step), "--finetune", "--no-load-optim",
                   "--no-load-rng"]
    settings = {"eval_batches": own.eval_batches, "position_bins": own.position_bins, "passkey_lengths": lengths,
                "passkey_depths": depths, "passkey_trials": own.passkey_trials,
                "output": os.path.abspath(os.path.join(own.output_dir, "eval.json")), "checkpoint": own.load,
                "iteration": step, "seq_length": seq, "context_parallel_size": cp,
                "attention": "megatron" if own.megatron_attention else "plugin"}
    return worker_argv, settings


def main(argv: Optional[list[str]] = None) -> int:
    from megatron_longctx.job.pretrain import entry_args
    from megatron_longctx.job import checkpoint_guard as guard

    parsed = entry_args("eval", build_parser(), argv)
    if parsed is None:
        return EXIT_BAD_ARGS
    own, megatron_argv = parsed
    try:
        worker_argv, settings = plan(own, megatron_argv)
    except (ValueError, guard.CheckpointError) as exc:
        print(f"megatron-longctx eval: error: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    os.makedirs(own.output_dir, exist_ok=True)
    start = time.perf_counter()
    env = {"LONGCTX_BASELINE": "1" if own.megatron_attention else "0"}
    try:
        rc, reports = run_phase(worker_argv, own.nproc_per_node, {"name": "eval", "progress": False,
                                                                  "evaluate": settings}, env)
    except Interrupted as exc:
        print(f"megatron-longctx eval: {exc}; every rank has been stopped", file=sys.stderr)
        return 128 + exc.signum
    if rc != 0:
        detail = "".join(f"\n  {r.strip().splitlines()[-1]}" for r in reports if r.strip())
        print(f"megatron-longctx eval: the ranks failed (exit {rc}){detail}", file=sys.stderr)
        return rc
    from megatron_longctx.job import eval_report

    result = json.load(open(settings["output"]))
    print(eval_report.table(result), flush=True)
    for path in eval_report.plots(result, own.output_dir):
        print(f"megatron-longctx eval: wrote {path}")
    print(f"megatron-longctx eval: {time.perf_counter() - start:.0f} s; {settings['output']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
