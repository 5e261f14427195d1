"""Context-parallel attention benchmark on CPU: load balance, bytes on the wire, ring wall time.

Prints three tables and writes JSON::

    python -m megatron_longctx.bench.cp_attention_bench --repeats 3 --json bench-results/cp_attention_bench.json

1. Work balance: forward attention FLOPs per rank read off the schedule each algorithm runs
   (:func:`megatron_longctx.attention.schedule_flops`, no processes), Megatron's zigzag layout
   against naive contiguous sharding; max/mean per configuration (1.00 = perfect).
2. Bytes each rank sends per layer, counted by the communication layer itself
   (``attention.comm.STATS``) on gloo ranks, against the closed-form bytes of :func:`anchor_forward_bytes`.
3. Wall time of forward + backward, causal, ``cp=2`` ring on two single-threaded ranks against the
   same block kernel over the whole sequence in one process with two threads (same total threads);
   speed-up = single / ring (1.0 = no overhead from splitting the work).  CPU seconds (all threads,
   both ranks) are printed beside it: on a shared machine they are the steadier measure.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from megatron_longctx.attention import cp_attention, schedule_flops, shard_sequence
from megatron_longctx.attention.comm import STATS
from megatron_longctx.attention.layout import dense_layout as SeqLayout
from megatron_longctx.attention.schedule import ring_schedule
from megatron_longctx.kernels.base import BlockMask
from megatron_longctx.procs import spawn_ranks
from megatron_longctx.bench import harness

SPAWN_TIMEOUT_S = 1800.0  # per multi-rank measurement; a rank that raises ends it at once

# ---------------------------------------------------------------------------------------- balance


def balance_rows(cp_sizes=(2, 4, 8), chunk: int = 1024, heads: int = 32, d: int = 128) -> list[dict]:
    """Per-rank forward FLOPs and max/mean for each (algorithm, layout, mask) at each cp size."""
    configs = [  # (label, algorithm, zigzag, window, ulysses_size)
        ("ring, zigzag", "ring", True, None, None),
        ("ring, contiguous", "ring", False, None, None),
        ("allgather, zigzag", "allgather", True, None, None),
        ("hybrid U=2, zigzag", "hybrid", True, None, 2),
        ("ring, zigzag, window 1024", "ring", True, (1024, 0), None),
        ("ring, contiguous, window 1024", "ring", False, (1024, 0), None),
    ]
    rows = []
    for cp in cp_sizes:
        s = 2 * cp * chunk
        for label, algorithm, zigzag, window, u in configs:
            flops = schedule_flops(algorithm, cp, s, window_size=window, heads=heads, d_qk=d, ulysses_size=u,
                                   zigzag=zigzag)
            row = {"cp": cp, "seq": s, "config": label, "flops_per_rank": flops,
                   "max_over_mean": max(flops) / (sum(flops) / cp)}
            if algorithm == "ring":
                mask = BlockMask(causal=True, window=window or (-1, -1))
                row["ring_transfers"] = ring_schedule(SeqLayout(cp, chunk, zigzag), mask).transfers
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ bytes


def anchor_forward_bytes(
    algorithm: str, p: int, s: int, b: int, hq: int, hkv: int, d: int, e: int, u: int = 1
) -> float:
    """Closed-form forward bytes each rank sends per layer (the ring passes K/V; Ulysses all-to-alls Q/K/V/O).

    Hybrid: the Ulysses formula over its ``u``-rank all-to-all groups plus the ring formula across them.
    """
    if algorithm in ("ring", "allgather"):
        return (p - 1) / p * 2 * b * s * hkv * d * e
    if algorithm == "ulysses":
        return (p - 1) / p**2 * b * s * d * (2 * hq + 2 * hkv) * e
    r = p // u  # hybrid: all-to-alls inside groups of u, ring across r groups, over s/p tokens per rank
    return (u - 1) / (u * p) * b * s * d * (2 * hq + 2 * hkv) * e + (r - 1) / p * 2 * b * s * hkv * d * e


def _bytes_worker(p: int, shape: dict) -> list[dict]:
    rank = dist.get_rank()
    s, b, hq, hkv, d = (shape[key] for key in ("s", "b", "hq", "hkv", "d"))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, h, d, generator=gen, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    runs = [("ring", None), ("allgather", None), ("ulysses", None)] + ([("hybrid", 2)] if p >= 4 else [])
    rows = []
    for algorithm, u in runs:
        local = [shard_sequence(t, rank, p, 0).requires_grad_() for t in (q, k, v)]
        STATS.reset()
        out = cp_attention(*local, dist.group.WORLD, algorithm=algorithm, ulysses_size=u)
        fwd = dict(STATS.bytes_sent)
        STATS.reset()
        out.sum().backward()
        bwd = dict(STATS.bytes_sent)
        rows.append({"cp": p, "algorithm": algorithm + (f" U={u}" if u else ""), "fwd_bytes": sum(fwd.values()),
                     "bwd_bytes": sum(bwd.values()), "fwd_by_kind": fwd, "bwd_by_kind": bwd,
                     "anchor_fwd_bytes": anchor_forward_bytes(algorithm, p, s, b, hq, hkv, d, 2, u or 1)})
    return rows


def bytes_rows(
    cp_sizes=(2, 4), tokens_per_rank: int = 256, b: int = 1, hq: int = 8, hkv: int = 2, d: int = 64
) -> list[dict]:
    """Bytes each algorithm sends per rank, forward and backward, on ``cp`` gloo ranks (bfloat16)."""
    rows = []
    for p in cp_sizes:
        shape = {"s": p * tokens_per_rank, "b": b, "hq": hq, "hkv": hkv, "d": d}
        rows += spawn_ranks(p, _bytes_worker, (p, shape), timeout=SPAWN_TIMEOUT_S)[0]
    return rows


# -------------------------------------------------------------------------------------- wall time


def _fwd_bwd_seconds(q, k, v, group, repeats: int) -> list[tuple[float, float]]:
    """(wall seconds, CPU seconds of this process) of each timed forward + backward."""
    times = []
    for i in range(repeats + 1):  # the first run warms up
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        if group is not None:
            dist.barrier(group)
        t0, c0 = time.perf_counter(), time.process_time()
        out = cp_attention(*leaves, group, algorithm="ring")
        out.backward(torch.ones_like(out))
        if group is not None:
            dist.barrier(group)
        if i:
            times.append((time.perf_counter() - t0, time.process_time() - c0))
    return times


def _ring_worker(shape: dict, repeats: int) -> list[tuple[float, float]]:
    torch.set_num_threads(1)
    rank, p = dist.get_rank(), dist.get_world_size()
    q, k, v = _walltime_inputs(shape)
    local = [shard_sequence(t, rank, p, 0) for t in (q, k, v)]
    return _fwd_bwd_seconds(*local, dist.group.WORLD, repeats)


def _walltime_inputs(shape: dict):
    gen = torch.Generator().manual_seed(0)
    s, b, hq, hkv, d = (shape[key] for key in ("s", "b", "hq", "hkv", "d"))
    return tuple(torch.randn(s, b, h, d, generator=gen) for h in (hq, hkv, hkv))


def walltime_row(shape: dict, repeats: int) -> dict:
    ring = spawn_ranks(2, _ring_worker, (shape, repeats), timeout=SPAWN_TIMEOUT_S)
    ring_wall = [max(w for w, _ in per_rank) for per_rank in zip(*ring)]  # a step ends with the slower rank
    ring_cpu = [sum(c for _, c in per_rank) for per_rank in zip(*ring)]  # both ranks together
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        single = _fwd_bwd_seconds(*_walltime_inputs(shape), None, repeats)
    finally:
        torch.set_num_threads(threads)
    single_wall, single_cpu = [w for w, _ in single], [c for _, c in single]
    median = statistics.median
    return {"shape": shape, "dtype": "float32", "causal": True,
            "single_2_threads_s": median(single_wall), "ring_cp2_1_thread_each_s": median(ring_wall),
            "speedup": median(single_wall) / median(ring_wall),
            "single_cpu_s": median(single_cpu), "ring_cpu_s_both_ranks": median(ring_cpu),
            "single_wall_all_s": single_wall, "ring_wall_all_s": ring_wall}


# ------------------------------------------------------------------------------------------ report


def _print_tables(balance: list[dict], wire: list[dict], wall: dict) -> None:
    print("\n1. Forward attention FLOPs per rank (from the executed schedule), causal, 1024-token chunks")
    print(harness.table([("cp", lambda r: r["cp"], "d"), ("configuration", lambda r: r["config"], ""),
                         ("max/mean", lambda r: r["max_over_mean"], ".3f"),
                         ("ring transfers", lambda r: r.get("ring_transfers", ""), "")], balance))
    print("\n2. Bytes sent per rank per layer (bf16, b=1, hq=8, hkv=2, d=64, 256 tokens per rank)")
    print(harness.table([("cp", lambda r: r["cp"], "d"), ("algorithm", lambda r: r["algorithm"], ""),
                         ("fwd measured", lambda r: r["fwd_bytes"], ","),
                         ("fwd formula", lambda r: r["anchor_fwd_bytes"], ",.0f"),
                         ("ratio", lambda r: r["fwd_bytes"] / r["anchor_fwd_bytes"], ".2f"),
                         ("bwd measured", lambda r: r["bwd_bytes"], ","),
                         ("bwd/fwd", lambda r: r["bwd_bytes"] / r["fwd_bytes"], ".2f")], wire))
    print("\n3. Forward + backward wall time, causal, float32, "
          + ", ".join(f"{k}={v}" for k, v in wall["shape"].items()))
    print(f"   {'':<40} {'wall s':>8} {'CPU s':>8}   (medians; CPU s: all threads / ranks)")
    print(f"   {'one process, 2 threads, whole sequence':<40} {wall['single_2_threads_s']:>8.3f} "
          f"{wall['single_cpu_s']:>8.3f}")
    print(f"   {'cp=2 ring, 2 ranks x 1 thread':<40} {wall['ring_cp2_1_thread_each_s']:>8.3f} "
          f"{wall['ring_cpu_s_both_ranks']:>8.3f}")
    print(f"   speed-up single / ring (wall): {wall['speedup']:.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per wall-time measurement (median)")
    parser.add_argument("--seq", type=int, default=4096, help="global sequence length of the wall-time run")
    parser.add_argument("--json", default="bench-results/cp_attention_bench.json", help="where to write the results")
    opts = parser.parse_args(argv)

    balance = balance_rows()
    wire = bytes_rows()
    wall = walltime_row({"s": opts.seq, "b": 1, "hq": 8, "hkv": 2, "d": 64}, opts.repeats)
    _print_tables(balance, wire, wall)
    harness.write_json(opts.json, {"meta": harness.environment(), "balance": balance, "bytes": wire, "walltime": wall})


if __name__ == "__main__":
    main()
