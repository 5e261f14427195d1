"""``megatron-longctx extend``: staged context extension in one command.

    megatron-longctx extend --stages 8K:200,32K:100,128K:50 --rotary-base 500000,8000000,128000000 \\
        [--load CKPT] [--output-dir runs/extend] [Megatron and --longctx-* flags]

Each stage is one ``megatron-longctx run`` at its length for its steps (no baseline or resume-check
phase), saving into ``OUTPUT_DIR/stage<i>-<length>/checkpoint``.  Stage 1 starts from ``--load`` (weights
only, ``--finetune``; the source is never written) or from a fresh initialisation; each later stage
loads the previous stage's final checkpoint the same way.  A stage whose checkpoint already reached its
steps is skipped; one that stopped part-way resumes from its newest checkpoint (weights, Adam state,
schedule and data position, as ``run`` resumes), so running the same command again continues where it
stopped.  With ``--plan-model``/``--plan-gpus`` each stage takes the planner's layout for its length
(TP, CP, recompute, offload, tiles: :func:`megatron_longctx.plan.recommend.recommend`, the flags of
:func:`megatron_longctx.plan.flags.all_flags`; the user's flags after them win); otherwise the
context-parallel size of a stage is the number of local ranks (``--nproc-per-node``) unless
``--context-parallel-size`` is given.  A stage ``LENGTH:STEPS@SHORT:FRACTION`` trains ``FRACTION`` of its
steps, spread evenly, on ``SHORT``-token batches (``run --mix-short``, :mod:`megatron_longctx.job.mix`).
``OUTPUT_DIR/extend.json`` records each stage's length, steps, mix, RoPE base, layout and state.  Before the
first stage starts, every stage's command line (with the planner's layout for its length) passes ``run``'s own
checks, so a stage that would be refused is refused before anything is trained or written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from typing import Any, NamedTuple, Optional

from megatron_longctx.job import checkpoint_guard as guard
from megatron_longctx.job import mix as mix_mod
from megatron_longctx.plan.model import parse_tokens

EXIT_BAD_ARGS = 2
STAGES_EXAMPLE = "8K:200,32K:100,128K:50"


class Stage(NamedTuple):
    """One stage: ``steps`` steps at ``length`` tokens, ``mix`` of them on short sequences (``None``: none)."""

    length: int
    steps: int
    mix: Optional[mix_mod.Mix] = None


def _parse_stage(text: str, item: str) -> Stage:
    head, at, tail = item.partition("@")
    try:
        stage = Stage(*mix_mod.pair(head, parse_tokens, int))
    except ValueError:
        raise ValueError(f"--stages {text!r}: {item!r} is not LENGTH:STEPS[@SHORT:FRACTION]; write e.g. --stages "
                         f"{STAGES_EXAMPLE}, or 1M:100@4K:0.5 for half the steps on 4K-token batches") from None
    if stage.length < 1 or stage.steps < 1:
        raise ValueError(f"--stages {text!r}: {item!r} needs a length and steps >= 1")
    if at:
        try:
            mix = mix_mod.parse(tail, flag="--stages")
        except ValueError as exc:
            raise ValueError(f"--stages {text!r}: after '@' in {item!r}, {str(exc)[len('--stages '):]}") from None
        if mix.short >= stage.length:
            raise ValueError(f"--stages {text!r}: {item!r} mixes in {mix.short}-token batches, not shorter than the "
                             f"stage's {stage.length}; give a shorter one, e.g. {head}@{max(1, stage.length // 8)}:"
                             f"{mix.fraction:g}")
        stage = stage._replace(mix=mix)
    return stage


def parse_stages(text: str) -> list[Stage]:
    """``"8K:200,1M:100@4K:0.5"`` -> ``[Stage(8192, 200), Stage(1048576, 100, Mix(4096, 0.5))]``; ``ValueError``
    naming ``--stages`` and the fix."""
    stages = [_parse_stage(text, item) for item in text.split(",")]
    for a, b in zip(stages, stages[1:]):
        if b.length < a.length:
            raise ValueError(f"--stages {text!r}: the length shrinks from {a.length} to {b.length}; give the stages "
                             "in increasing length")
    return stages


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-longctx extend", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="Any other flag is Megatron-LM's or a --longctx-* flag, given to every stage.")
    p.add_argument("--stages", required=True, help="LENGTH:STEPS,... in increasing length (K = 1024, M = 1024^2); "
                   "LENGTH:STEPS@SHORT:FRACTION trains FRACTION of the stage's steps on SHORT-token batches")
    p.add_argument("--rotary-base", default=None, help="one RoPE base for all stages, or one per stage (a,b,c)")
    p.add_argument("--load", default=None, help="the checkpoint stage 1 starts from (weights only; never written)")
    p.add_argument("--output-dir", default="runs/extend", help="one folder per stage and extend.json")
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks to start for each stage")
    p.add_argument("--context-parallel-size", type=int, default=None,
                   help="CP size of every stage (default: --nproc-per-node)")
    p.add_argument("--save-interval", type=int, default=None, help="checkpoint every N steps within a stage")
    g = p.add_argument_group("the planner's layout per stage (GPUs)")
    g.add_argument("--plan-model", default=None, help="a planner model preset (e.g. llama3-8b): each stage takes "
                   "the planner's TP, CP, recompute, offload and tiles for its length")
    g.add_argument("--plan-gpus", type=int, default=None, help="GPUs the planner lays each stage out on")
    g.add_argument("--plan-gpu", default="h100", help="the planner's GPU preset (h100, h200, ...)")
    return p


def planned_flags(own: argparse.Namespace, length: int) -> tuple[list[str], str]:
    """The planner's flags for one stage (Megatron's and --longctx-*) and its one-line summary."""
    from megatron_longctx.plan import cli as plan_cli
    from megatron_longctx.plan.efficiency import resolve
    from megatron_longctx.plan.flags import all_flags
    from megatron_longctx.plan.recommend import recommend

    args = plan_cli.build_parser().parse_args(["--model", own.plan_model, "--seq-length", str(length),
                                               "--num-gpus", str(own.plan_gpus), "--gpu", own.plan_gpu])
    m, hw, c = plan_cli.model_from_args(args), plan_cli.hardware_from_args(args), plan_cli.constraints_from_args(args)
    eff = resolve(hw.family, args.attention_backend, args.fp8)
    plan = recommend(m, length, own.plan_gpus, hw, c, micro_batch=args.micro_batch_size, eff=eff)
    return all_flags(plan), plan_cli.format_plan(plan).splitlines()[1]


def check_stage(run_argv: list[str], where: str) -> None:
    """``megatron-longctx run``'s checks of one stage's command line (the planner's layout, its length, its mix):
    ``ValueError`` saying which stage and the run's own message."""
    from megatron_longctx.job import pretrain

    try:
        pretrain.checked_job(*pretrain.build_parser().parse_known_args(run_argv))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _bases(text: Optional[str], n: int) -> list[Optional[str]]:
    if text is None:
        return [None] * n
    bases = [b.strip() for b in text.split(",")]
    if len(bases) == 1:
        bases *= n
    if len(bases) != n or not all(b.isdigit() and int(b) > 0 for b in bases):
        raise ValueError(f"--rotary-base {text!r}: give one positive integer base, or one per stage ({n})")
    return bases


def stage_dir(output_dir: str, index: int, length: int) -> str:
    return os.path.join(output_dir, f"stage{index}-{length}")


def stage_state(save: str, steps: int) -> tuple[str, Optional[int]]:
    """``("done", None)``, ``("resume", iteration)`` or ``("start", None)`` from a stage's checkpoint folder."""
    tracked = guard.tracker_iteration(save) if os.path.isdir(save) else None
    if tracked is None:
        return "start", None
    return ("done", None) if tracked >= steps else ("resume", tracked)


def stage_argv(own: argparse.Namespace, megatron_argv: list[str], index: int, stages: list[Stage],
               base: Optional[str]) -> tuple[list[str], dict[str, Any]]:
    """``megatron-longctx run``'s arguments for stage ``index`` and its record for extend.json."""
    length, steps, mix = stages[index]
    out = stage_dir(own.output_dir, index + 1, length)
    save = os.path.join(out, "checkpoint")
    planned, layout = ([], None) if own.plan_model is None else planned_flags(own, length)
    if planned:
        cp = int(planned[planned.index("--context-parallel-size") + 1])
    else:
        cp = own.context_parallel_size or own.nproc_per_node
    state, at = stage_state(save, steps)
    argv = [*planned, *megatron_argv, "--seq-length", str(length), "--max-position-embeddings", str(length),
            "--context-parallel-size", str(cp), "--train-iters", str(steps), "--output-dir", out,
            "--nproc-per-node", str(own.nproc_per_node), "--no-baseline", "--no-resume-check", "--no-progress"]
    if own.save_interval:
        argv += ["--save-interval", str(own.save_interval)]
    if base is not None:
        argv += ["--rotary-base", base]
    if mix is not None:
        argv += ["--mix-short", mix.text()]
    source = own.load if index == 0 else os.path.join(stage_dir(own.output_dir, index, stages[index - 1].length),
                                                      "checkpoint")
    if state == "resume":
        argv += ["--load", save]
    elif source is not None:
        argv += ["--load", source, "--finetune"]
    record = {"stage": index + 1, "seq_length": length, "steps": steps, "rotary_base": base,
              "mix_short": None if mix is None else dataclasses.asdict(mix),
              "context_parallel_size": cp, "checkpoint": save, "source": save if state == "resume" else source,
              "state": state, "resumed_from": at, "layout": layout}
    return argv, record


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, megatron_argv = build_parser().parse_known_args(argv)
    try:
        stages = parse_stages(own.stages)
        bases = _bases(own.rotary_base, len(stages))
        if own.load is not None and not os.path.isdir(own.load):
            raise ValueError(f"--load {own.load}: no such directory")
        if (own.plan_model is None) != (own.plan_gpus is None):
            raise ValueError("--plan-model and --plan-gpus go together (the planner lays out a model on GPUs)")
        if own.plan_model is not None and own.context_parallel_size is not None:
            raise ValueError("--context-parallel-size with --plan-model: the planner chooses CP per stage; drop one")
        for number, stage in enumerate(stages, 1):  # the mixes, before Megatron is imported for the rest
            if stage.mix is not None and own.plan_model is None:  # (the planner's CP: in the runs' checks)
                mix_mod.check(stage.mix, stage.length, own.context_parallel_size or own.nproc_per_node,
                              flag=f"--stages {own.stages!r}: stage {number} mixes")
        for index in range(len(stages)):  # every stage's run checked as `run` will check it, before any runs
            check_stage(stage_argv(own, megatron_argv, index, stages, bases[index])[0],
                        f"--stages {own.stages!r}: stage {index + 1} ({stages[index].length} tokens)")
    except (ValueError, SystemExit) as exc:  # PlanInfeasible is a ValueError; the planner's parser exits
        print(f"megatron-longctx extend: error: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    os.makedirs(own.output_dir, exist_ok=True)
    records = []
    for index in range(len(stages)):
        args, record = stage_argv(own, megatron_argv, index, stages, bases[index])
        records.append(record)
        if record["state"] == "done":
            print(f"megatron-longctx extend: stage {index + 1} ({record['seq_length']} tokens) already done", flush=True)
            continue
        print(f"megatron-longctx extend: stage {index + 1}/{len(stages)}: {record['seq_length']} tokens, "
              f"{record['steps']} steps, CP={record['context_parallel_size']}, rotary base "
              f"{record['rotary_base'] or 'the flags'}, from {record['source'] or 'a fresh initialisation'}"
              + (f" (resuming at iteration {record['resumed_from']})" if record["state"] == "resume" else ""),
              flush=True)
        rc = subprocess.call([sys.executable, "-m", "megatron_longctx.cli", "run", *args])
        record["exit"] = rc
        with open(os.path.join(own.output_dir, "extend.json"), "w") as f:
            json.dump({"stages": records}, f, indent=1)
        if rc != 0:
            print(f"megatron-longctx extend: stage {index + 1} failed (exit {rc}); run the same command again to "
                  "resume it from its last checkpoint", file=sys.stderr)
            return rc
    with open(os.path.join(own.output_dir, "extend.json"), "w") as f:
        json.dump({"stages": records}, f, indent=1)
    print(f"megatron-longctx extend: {len(stages)} stages done; the last checkpoint is {records[-1]['checkpoint']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
