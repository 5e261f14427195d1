"""``megatron-longctx``: the console script.

    megatron-longctx run   [args]   the main job: long-context GPT training on Megatron-Core with CP
    megatron-longctx bench [args]   regression benchmark of the plugin against baseline Megatron
    megatron-longctx bench NAME [args]   another benchmark (scaling, peers, kernels, ...; `bench list`)
    megatron-longctx eval  [args]   a checkpoint evaluated at length: loss per position, passkey retrieval
    megatron-longctx extend [args]  staged context extension from a checkpoint, resumable
    megatron-longctx plan  [args]   memory/time planner: which configuration fits, and the flags for it

Each sub-command's ``--help`` lists its own options.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "run": ("megatron_longctx.job.pretrain", "the main job: long-context GPT training with context parallelism"),
    "bench": ("megatron_longctx.bench.commands",
              "regression benchmark against baseline Megatron; `bench NAME`: the others (`bench list`)"),
    "eval": ("megatron_longctx.job.evaluate",
             "a checkpoint at length, forward only under CP: loss per position and passkey retrieval"),
    "extend": ("megatron_longctx.job.extend",
               "staged context extension: LENGTH:STEPS stages, a RoPE base per stage, resumable"),
    "plan": ("megatron_longctx.plan.cli", "plan memory, time and flags for a long-context run"),
}


def _usage() -> str:
    lines = ["usage: megatron-longctx {" + ",".join(COMMANDS) + "} [args...]", ""]
    lines += [f"  {name:<7} {doc}" for name, (_, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"megatron-longctx: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
