"""Packed (THD) attention against dense on one rank: time per visible pair and kernel calls.

A pack of many short documents is the same attention as its documents one by one; what it costs beyond
that is the per-document overhead (calls, slicing, merging).  This runs forward + backward of one rank's
local attention through the production block loop (``attention.segments``, the path every CP algorithm
takes) for a pack of ``--docs`` documents and for dense causal sequences, and reports, per backend:

* ``ns/pair``: wall time per visible (query, key) pair (forward + backward, median);
* ``calls``: the backend's block calls, forward and backward (a many-block call counts once);
* ``packed/dense``: time per pair of the pack over that of a dense causal sequence with the same
  number of visible pairs (the same work in one document).

::

    python -m megatron_longctx.bench.packed_bench --docs 64 --doc-len 1024 --json packed_bench.json
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

import torch

from megatron_longctx.attention.layout import Packing, SeqLayout
from megatron_longctx.attention.schedule import ring_schedule
from megatron_longctx.attention.block_loop import Rows, attend_local, attend_local_backward
from megatron_longctx.kernels import select
from megatron_longctx.kernels.base import BlockMask
from megatron_longctx.bench import harness
from megatron_longctx.patching import patch


class _Counter:
    """Counts a backend's block calls (``forward``/``backward``/``*_blocks``) while installed."""

    NAMES = ("forward", "backward", "forward_blocks", "backward_blocks")

    def __init__(self, module):
        self.module, self.counts, self.patches = module, dict.fromkeys(self.NAMES, 0), []

    def __enter__(self):
        for name in self.NAMES:
            original = getattr(self.module, name, None)
            if original is None:
                continue

            def counted(*args, _name=name, _original=original, **kwargs):
                self.counts[_name] += 1
                return _original(*args, **kwargs)

            self.patches.append(patch(self.module, name, counted, reason="the benchmark counts the backend's calls"))
        return self

    def __exit__(self, *exc):
        while self.patches:
            self.patches.pop().undo()


def _case(lengths: list[int], mask: BlockMask, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    packing = Packing.from_lengths(lengths, 1)
    calls = ring_schedule(SeqLayout(packing, 1), mask).calls[0][0]
    gen = torch.Generator().manual_seed(0)
    t = packing.padded_total
    q = torch.randn(1, t, heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(1, t, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    dout = torch.randn(1, t, heads, head_dim, generator=gen).to(dtype)
    return calls, q, k, v, dout, sum(c.pairs for c in calls)


def measure(lengths: list[int], mask: BlockMask, backend: str, repeats: int, heads: int, kv_heads: int,
            head_dim: int, dtype: torch.dtype) -> dict:
    calls, q, k, v, dout, pairs = _case(lengths, mask, heads, kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5

    def step():
        out, lse = attend_local(q, k, v, calls, scale, backend)
        attend_local_backward(Rows(q, out, lse, dout), k, v, calls, scale, backend)

    step()  # warm-up (and the schedule's caches)
    with _Counter(select.BACKENDS[backend]) as counter:
        step()
    seconds = harness.median_seconds(step, repeats, warm_up=False)
    return {"docs": len(lengths), "tokens": sum(lengths), "pairs": pairs, "schedule_calls": len(calls),
            "backend_calls": counter.counts, "seconds": seconds, "ns_per_pair": seconds / pairs * 1e9}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=64, help="documents in the pack")
    parser.add_argument("--doc-len", type=int, default=1024, help="tokens per document")
    parser.add_argument("--uneven", action="store_true", help="document lengths from doc-len/2 to 3*doc-len/2")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--backends", nargs="+", default=["cpu_flash"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", default="packed_bench.json")
    opts = parser.parse_args(argv)
    if opts.docs < 1 or opts.doc_len < 2:
        raise ValueError(f"--docs {opts.docs} and --doc-len {opts.doc_len}: need >= 1 document of >= 2 tokens")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    dtype = getattr(torch, opts.dtype)
    mask = BlockMask(causal=True)
    if opts.uneven:
        lengths = [opts.doc_len // 2 + (i * opts.doc_len) // max(1, opts.docs - 1) for i in range(opts.docs)]
    else:
        lengths = [opts.doc_len] * opts.docs
    pack_pairs = sum(n * (n + 1) // 2 for n in lengths)
    dense_len = int(math.isqrt(2 * pack_pairs))  # a causal sequence with the pack's number of pairs
    rows = []
    for backend in opts.backends:
        for name, case in (("packed", lengths), ("dense, same pairs", [dense_len])):
            r = measure(case, mask, backend, opts.repeats, opts.heads, opts.kv_heads, opts.head_dim, dtype)
            rows.append({"backend": backend, "case": name, **r})
    for r in rows:
        dense = next(x for x in rows if x["backend"] == r["backend"] and x["case"] != "packed")
        r["packed_over_dense"] = r["ns_per_pair"] / dense["ns_per_pair"]

    def calls(kind: str) -> Callable[[dict], int]:
        return lambda r: r["backend_calls"][f"{kind}_blocks"] or r["backend_calls"][kind]

    print(harness.table([("backend", lambda r: r["backend"], ""), ("case", lambda r: r["case"], ""),
                         ("docs", lambda r: r["docs"], "d"), ("tokens", lambda r: r["tokens"], "d"),
                         ("Mpairs", lambda r: r["pairs"] / 1e6, ".2f"), ("fwd calls", calls("forward"), "d"),
                         ("bwd calls", calls("backward"), "d"), ("s", lambda r: r["seconds"], ".3f"),
                         ("ns/pair", lambda r: r["ns_per_pair"], ".1f"),
                         ("vs dense", lambda r: r["packed_over_dense"], ".2f")], rows))
    meta = harness.environment(dtype=opts.dtype, heads=opts.heads, kv_heads=opts.kv_heads, head_dim=opts.head_dim,
                               repeats=opts.repeats)
    harness.write_json(opts.json, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    main()
