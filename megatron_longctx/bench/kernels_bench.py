"""Block-kernel benchmark on CPU: ``cpu_flash`` against ``reference``, forward + backward wall time.

Prints a table and writes JSON (medians over ``--repeats`` timed runs after one warm-up)::

    python -m megatron_longctx.bench.kernels_bench --repeats 5 --json kernels_bench.json

Each shape is one block call as the context-parallel algorithms make it: a causal diagonal block
(ring), a causal all-gather tail (short queries against every earlier key), a sliding window and an
MLA block (``d_qk != d_v``), with GQA where Llama-style models have it.

``--window-table`` times instead one diagonal block per length under full causal attention and
under a sliding window, ``cpu_flash`` only (4 query / 2 KV heads of 16): a window's time per token
stays flat with the length, full causal grows with it::

    python -m megatron_longctx.bench.kernels_bench --window-table --threads 1 --json window_table.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from megatron_longctx.kernels import BlockArgs, BlockMask, cpu_flash, reference
from megatron_longctx.bench import harness


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmarked block."""

    name: str
    s_q: int
    s_k: int
    h_q: int
    h_kv: int
    d_qk: int
    d_v: int
    mask: BlockMask
    q_start: int = 0
    k_start: int = 0
    b: int = 1


SHAPES = (
    Shape("ring diagonal, causal", 1024, 1024, 8, 2, 64, 64, BlockMask(causal=True)),
    Shape("all-gather tail, causal", 512, 2048, 8, 2, 64, 64, BlockMask(causal=True), q_start=1536),
    Shape("off-diagonal, no mask", 1024, 1024, 8, 2, 64, 64, BlockMask(causal=True), q_start=1024),
    Shape("sliding window 256", 1024, 1024, 8, 2, 64, 64, BlockMask(causal=True, window=(256, -1))),
    Shape("MLA 96/64, causal", 512, 512, 8, 8, 96, 64, BlockMask(causal=True)),
)
QUICK_SHAPES = tuple(dataclasses.replace(s, s_q=s.s_q // 4, s_k=s.s_k // 4, q_start=s.q_start // 4) for s in SHAPES)


def _inputs(shape: Shape, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(shape.b, shape.s_q, shape.h_q, shape.d_qk, generator=gen).to(dtype)
    k = torch.randn(shape.b, shape.s_k, shape.h_kv, shape.d_qk, generator=gen).to(dtype)
    v = torch.randn(shape.b, shape.s_k, shape.h_kv, shape.d_v, generator=gen).to(dtype)
    dout = torch.randn(shape.b, shape.s_q, shape.h_q, shape.d_v, generator=gen).to(dtype)
    args = BlockArgs(shape.d_qk**-0.5, shape.mask, shape.q_start, shape.k_start)
    return q, k, v, dout, args


def _time_fwd_bwd(backend, q, k, v, dout, args, repeats: int) -> tuple[float, float]:
    """Median forward and backward seconds."""
    out, lse = backend.forward(q, k, v, args)  # warm-up
    backend.backward(dout, q, k, v, out, lse, args)
    fwd, bwd = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, lse = backend.forward(q, k, v, args)
        t1 = time.perf_counter()
        backend.backward(dout, q, k, v, out, lse, args)
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return statistics.median(fwd), statistics.median(bwd)


def run(shapes, dtypes, repeats: int) -> list[dict]:
    rows = []
    for shape in shapes:
        for dtype in dtypes:
            q, k, v, dout, args = _inputs(shape, dtype)
            row = {"shape": dataclasses.asdict(shape) | {"mask": dataclasses.asdict(shape.mask)}, "dtype": str(dtype)}
            for backend in (cpu_flash, reference):
                fwd, bwd = _time_fwd_bwd(backend, q, k, v, dout, args, repeats)
                row[backend.name] = {"fwd_s": fwd, "bwd_s": bwd, "total_s": fwd + bwd}
            row["speedup"] = row["reference"]["total_s"] / row["cpu_flash"]["total_s"]
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    head = f"{'block':<26} {'dtype':<15} {'cpu_flash fwd+bwd ms':>21} {'reference fwd+bwd ms':>21} {'speedup':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        cf, ref = r["cpu_flash"], r["reference"]
        print(
            f"{r['shape']['name']:<26} {r['dtype']:<15} "
            f"{cf['fwd_s'] * 1e3:>9.1f}+{cf['bwd_s'] * 1e3:<11.1f} "
            f"{ref['fwd_s'] * 1e3:>9.1f}+{ref['bwd_s'] * 1e3:<11.1f} {r['speedup']:>7.2f}x"
        )


WINDOW_TABLE_LENGTHS = (4096, 16384, 65536, 262144)
FULL_CAUSAL_MAX = 16384  # full causal past this takes minutes per call on one core


def window_table(lengths, window: int, repeats: int) -> list[dict]:
    """Forward and backward seconds of one causal diagonal block per length, full and windowed."""
    rows = []
    for s in lengths:
        for name, mask in (("full causal", BlockMask(causal=True)), (f"window ({window}, 0)",
                                                                     BlockMask(causal=True, window=(window, 0)))):
            if mask.left < 0 and s > FULL_CAUSAL_MAX:
                continue
            shape = Shape(name, s, s, 4, 2, 16, 16, mask)
            q, k, v, dout, args = _inputs(shape, torch.float32)
            fwd, bwd = _time_fwd_bwd(cpu_flash, q, k, v, dout, args, repeats)
            rows.append({"tokens": s, "mask": name, "fwd_s": fwd, "bwd_s": bwd, "us_per_token": (fwd + bwd) / s * 1e6})
    return rows


def print_window_table(rows: list[dict]) -> None:
    print(harness.table([("tokens", lambda r: r["tokens"], "d"), ("mask", lambda r: r["mask"], ""),
                         ("fwd ms", lambda r: r["fwd_s"] * 1e3, ".1f"), ("bwd ms", lambda r: r["bwd_s"] * 1e3, ".1f"),
                         ("µs/token", lambda r: r["us_per_token"], ".2f")], rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median reported)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="torch dtype names")
    parser.add_argument("--quick", action="store_true", help="quarter-length shapes")
    parser.add_argument("--json", default="kernels_bench.json", help="where to write the results")
    parser.add_argument("--window-table", action="store_true",
                        help="full causal against a sliding window, one diagonal block per length (cpu_flash)")
    parser.add_argument("--window", type=int, default=1024, help="--window-table: the window's left side")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(WINDOW_TABLE_LENGTHS),
                        help="--window-table: block lengths (full causal up to 16384)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    opts = parser.parse_args(argv)
    if opts.repeats < 1:
        parser.error(f"--repeats={opts.repeats}: must be >= 1")
    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    meta = harness.environment()
    if opts.window_table:
        if opts.window < 0 or any(n < 1 for n in opts.lengths):
            parser.error("--window must be >= 0 and --lengths positive")
        rows = window_table(opts.lengths, opts.window, opts.repeats)
        print_window_table(rows)
        harness.write_json(opts.json, {"meta": meta, "repeats": opts.repeats, "window": opts.window, "results": rows})
        return
    dtypes = []
    for dtype_name in opts.dtypes:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            parser.error(f"--dtypes: {dtype_name!r} is not a torch dtype (try float32, bfloat16, float64)")
        dtypes.append(dtype)
    rows = run(QUICK_SHAPES if opts.quick else SHAPES, dtypes, opts.repeats)
    print_table(rows)
    harness.write_json(opts.json, {"meta": meta, "repeats": opts.repeats, "results": rows})


if __name__ == "__main__":
    main()
