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
from typing import Optional

# name -> (module whose main(argv) runs it, what it does)
Table = dict[str, tuple[str, str]]

COMMANDS: Table = {
    "run": ("megatron_longctx.job.pretrain", "the main job: long-context GPT training with context parallelism"),
    "bench": ("megatron_longctx.bench.commands",
              "regression benchmark against baseline Megatron; `bench NAME`: the others (`bench list`)"),
    "eval": ("megatron_longctx.job.evaluate",
             "a checkpoint at length, forward only under CP: loss per position and passkey retrieval"),
    "extend": ("megatron_longctx.job.extend",
               "staged context extension: LENGTH:STEPS stages, a RoPE base per stage, resumable"),
    "plan": ("megatron_longctx.plan.cli", "plan memory, time and flags for a long-context run"),
}


def usage(head: str, table: Table) -> str:
    width = max(len(name) for name in table) + 1
    return "\n".join([head, ""] + [f"  {name:<{width}} {doc}" for name, (_, doc) in table.items()])


def dispatch(prog: str, kind: str, table: Table, name: str, argv: list[str], head: str) -> int:
    """``table[name]``'s ``main(argv)``, its parsers' usage line saying ``prog name``; an unknown ``name``: the
    listing on stderr and exit code 2."""
    if name not in table:
        print(f"{prog}: unknown {kind} {name!r}\n\n{usage(head, table)}", file=sys.stderr)
        return 2
    module = importlib.import_module(table[name][0])
    program, sys.argv[0] = sys.argv[0], f"{prog} {name}"  # the usage line of a parser without prog
    try:
        return int(module.main(argv) or 0)
    finally:
        sys.argv[0] = program


HEAD = "usage: megatron-longctx {" + ",".join(COMMANDS) + "} [args...]"


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(HEAD, COMMANDS))
        return 0 if argv else 2
    return dispatch("megatron-longctx", "command", COMMANDS, argv[0], argv[1:], HEAD)


if __name__ == "__main__":
    sys.exit(main())
