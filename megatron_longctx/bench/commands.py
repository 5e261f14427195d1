"""``megatron-longctx bench [NAME] [args]``: every benchmark of the project under one command.

Without a name (or with flags first) it is the regression benchmark against baseline Megatron, the
README's; each name runs that benchmark's own ``main`` with the rest of the arguments (``--help`` lists
them).  The same modules run as ``python -m megatron_longctx.bench.<module>``.
"""

from __future__ import annotations

import sys
from typing import Optional

from megatron_longctx.cli import dispatch, usage

REGRESSION = "regression"
# name -> (module, what it measures)
BENCHMARKS = {name: (f"megatron_longctx.bench.{module}", doc) for name, (module, doc) in {
    REGRESSION: ("regression", "the plugin against baseline Megatron: time per token, memory, longest sequence"),
    "scaling": ("scaling", "one training step from 16K to 1M tokens: time and memory against length"),
    "peers": ("peers", "the peers side by side: DeepSpeed Ulysses, ALST's tiled MLP and loss, torch's context_parallel"),
    "live-memory": ("live_memory", "live tensor bytes per token at a step's peak, by what made them"),
    "memory-report": ("memory_report", "activation memory per feature: saved bytes per token per layer, and the peak"),
    "kernels": ("kernels_bench", "block kernels on the CPU: cpu_flash against reference, forward + backward"),
    "cp-attention": ("cp_attention_bench", "CP attention on the CPU: load balance, bytes on the wire, ring wall time"),
    "packed": ("packed_bench", "packed (THD) attention against dense on one rank: time per visible pair, kernel calls"),
    "packed-balance": ("packed_balance_bench", "attention work per CP rank for packed documents of skewed lengths"),
    "sinks": ("sinks_bench", "what attention sinks cost: one rank's attention with and without them"),
    "extension": ("extension", "context extension end to end: pretrain short, extend long, passkeys and loss before/after"),
}.items()}
HEAD = "usage: megatron-longctx bench [NAME] [args...]   (no NAME: regression)"


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["list"]:
        print(usage(HEAD, BENCHMARKS))
        return 0
    name = REGRESSION
    if argv and not argv[0].startswith("-"):
        name, argv = argv[0], argv[1:]
    elif "--scaling" in argv:  # the older spelling of `bench scaling`
        name, argv = "scaling", [a for a in argv if a != "--scaling"]
    return dispatch("megatron-longctx bench", "benchmark", BENCHMARKS, name, argv, HEAD)


if __name__ == "__main__":
    sys.exit(main())
