"""Attention work per context-parallel rank for packed documents of skewed lengths: before/after balancing.

Pure schedule arithmetic, no processes: for each rank, the forward attention FLOPs of its queries
(``4 * d * heads`` per visible same-document (query, key) pair; backward is about 2.5x this) under
three ways of sharding one packed sequence::

    contiguous   rank r holds tokens [r*t/cp, (r+1)*t/cp) of the packed sequence
    zigzag-seq   the whole packed sequence cut into 2*cp chunks, rank r keeps r and 2cp-1-r
                 (Megatron's per-sequence balancing applied to a packed batch)
    zigzag-doc   every document cut into 2*cp chunks, rank r keeps r and 2cp-1-r of each
                 (per-document balancing; the FLOPs are read off the ring schedule that runs)

and the forward kernel calls of each rank's ring: one per document block (``calls (doc)``, the CPU
backends) and one per piece kind per step (``calls (varlen)``, a variable-length backend).

Prints one table per length distribution and writes JSON::

    python -m megatron_longctx.bench.packed_balance_bench --cp 8 --json packed_balance.json
"""

from __future__ import annotations

import argparse
import random

from megatron_longctx.attention.layout import Packing, SeqLayout
from megatron_longctx.attention.schedule import ring_schedule
from megatron_longctx.attention.segments import visible_pairs
from megatron_longctx.kernels import varlen
from megatron_longctx.kernels.base import BlockArgs, BlockMask
from megatron_longctx.kernels.driver import flash2_pieces
from megatron_longctx.bench import harness

SCHEMES = ("contiguous", "zigzag-seq", "zigzag-doc")


def distributions(seed: int) -> dict[str, list[int]]:
    """Named document-length lists: one long document among many short ones, and a long tail."""
    rng = random.Random(seed)
    tail = []
    while sum(tail) < 131072:
        tail.append(max(1, min(32768, int(rng.lognormvariate(7.0, 1.2)))))
    return {
        "1x64K + 64x1K": [65536] + [1024] * 64,
        "64x1K + 1x64K": [1024] * 64 + [65536],
        f"long tail (lognormal, seed {seed})": tail,
    }


def _intervals_pairs(packing: Packing, intervals: list[tuple[int, int]], mask: BlockMask) -> int:
    """Visible same-document pairs of the queries at padded positions ``intervals`` (keys: their whole document)."""
    pairs = 0
    for lo, hi in intervals:
        for start, n in zip(packing.cu_seqlens_padded, packing.lengths):
            a, b = max(lo, start), min(hi, start + n)  # real tokens of this document inside the interval
            if a < b:
                pairs += visible_pairs(mask, a - start, b - a, 0, n)
    return pairs


def rank_pairs(scheme: str, packing: Packing, cp: int, mask: BlockMask) -> list[int]:
    """Visible (query, key) pairs per rank (per head) under ``scheme``."""
    t = packing.padded_total
    if scheme == "contiguous":
        return [_intervals_pairs(packing, [(r * t // cp, (r + 1) * t // cp)], mask) for r in range(cp)]
    if scheme == "zigzag-seq":
        c = t // (2 * cp)
        return [_intervals_pairs(packing, [(r * c, (r + 1) * c), ((2 * cp - 1 - r) * c, (2 * cp - r) * c)], mask)
                for r in range(cp)]
    schedule = ring_schedule(SeqLayout(packing, cp), mask)
    return [schedule.pairs(r) for r in range(cp)]


def measure(lengths: list[int], cp: int, mask: BlockMask, heads: int, head_dim: int) -> dict:
    """Per-rank forward FLOPs of every scheme for one length distribution."""
    # Every scheme shards the same padded sequence: per-document padding to 2*cp (zigzag-seq needs the
    # total divisible by 2*cp too, which per-document padding guarantees).
    packing = Packing.from_lengths(lengths, cp)
    flops_per_pair = 4 * head_dim * heads
    result = {"docs": len(lengths), "tokens": packing.total, "padded_tokens": packing.padded_total, "schemes": {}}
    for scheme in SCHEMES:
        flops = [p * flops_per_pair for p in rank_pairs(scheme, packing, cp, mask)]
        mean = sum(flops) / cp
        result["schemes"][scheme] = {
            "flops_per_rank": flops,
            "max_over_mean": max(flops) / mean if mean else 0.0,
            "max_over_min": max(flops) / min(flops) if min(flops) else float("inf"),
        }
    layout = SeqLayout(packing, cp)
    schedule = ring_schedule(layout, mask)
    result["ring_steps"] = len(schedule.offsets)
    result["kernel_calls_per_rank"] = [sum(len(step[r]) for step in schedule.calls) for r in range(cp)]
    result["varlen_calls_per_rank"] = [sum(varlen_calls(step[r], mask) for step in schedule.calls) for r in range(cp)]
    return result


def varlen_calls(calls, mask: BlockMask) -> int:
    """Forward kernel calls of one step's ``calls`` on a variable-length backend (``sdpa_cuda``): one per
    kind of flash-attn 2 piece (:func:`megatron_longctx.kernels.varlen.group_pieces`)."""
    blocks = [varlen.Block(c.q_lo, c.q_hi, c.k_lo, c.k_hi, BlockArgs(1.0, c.mask, c.q_start, c.k_start))
              for c in calls]
    return len(varlen.group_pieces(blocks, flash2_pieces))


def _table(name: str, res: dict, cp: int) -> str:
    lines = [f"\n{name}: {res['docs']} documents, {res['tokens']} tokens ({res['padded_tokens']} padded), "
             f"cp={cp}, ring steps {res['ring_steps']}",
             f"{'rank':>6} " + " ".join(f"{s + ' TFLOP':>18}" for s in SCHEMES)
             + f" {'calls (doc)':>12} {'calls (varlen)':>15}"]
    for r in range(cp):
        cells = " ".join(f"{res['schemes'][s]['flops_per_rank'][r] / 1e12:>18.3f}" for s in SCHEMES)
        lines.append(f"{r:>6} {cells} {res['kernel_calls_per_rank'][r]:>12} {res['varlen_calls_per_rank'][r]:>15}")
    lines.append(f"{'max/mean':>6} " + " ".join(f"{res['schemes'][s]['max_over_mean']:>18.3f}" for s in SCHEMES))
    lines.append(f"{'max/min':>6} " + " ".join(f"{res['schemes'][s]['max_over_min']:>18.3f}" for s in SCHEMES))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=8, help="context-parallel size")
    parser.add_argument("--heads", type=int, default=32, help="query heads (Llama-3-8B: 32)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim (Llama-3-8B: 128)")
    parser.add_argument("--window", type=int, default=-1, help="causal sliding window (left), -1 = full causal")
    parser.add_argument("--seed", type=int, default=0, help="seed of the long-tail distribution")
    parser.add_argument("--json", default="packed_balance.json", help="where to write the results")
    opts = parser.parse_args(argv)
    if opts.cp < 1:
        raise ValueError(f"--cp {opts.cp} must be >= 1")
    mask = BlockMask(causal=True, window=(opts.window, 0) if opts.window >= 0 else (-1, -1))
    results = {}
    for name, lengths in distributions(opts.seed).items():
        results[name] = measure(lengths, opts.cp, mask, opts.heads, opts.head_dim)
        print(_table(name, results[name], opts.cp))
    meta = harness.environment(cp=opts.cp, heads=opts.heads, head_dim=opts.head_dim, window=opts.window,
                               flops="forward attention, 4*head_dim*heads per visible same-document pair")
    harness.write_json(opts.json, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
