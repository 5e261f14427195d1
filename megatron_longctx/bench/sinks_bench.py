"""What attention sinks cost: forward + backward of one rank's attention with and without ``softmax_offset``.

Prints a table and writes JSON::

    python -m megatron_longctx.bench.sinks_bench                      # CPU, 2K tokens: seconds
    python -m megatron_longctx.bench.sinks_bench --seq 16384 --device cuda --json bench-results/sinks.json

The sink is applied once per query row to the merged ``(out, lse)`` (:mod:`megatron_longctx.attention.sinks`),
so its cost is linear in the tokens while the attention's is quadratic (or ``tokens x window``).  Two
measures per length: the whole call with and without sinks (their difference is within the noise of a
shared machine), and the sink's own work timed alone (:func:`~megatron_longctx.attention.sinks.add_sink`
and :func:`~megatron_longctx.attention.sinks.sink_grad` on tensors of the call's shapes) as a share of
the attention without sinks: the steadier number.  Causal, GQA, one rank (``cp_group=None``): the sink's
work is the same per row under every CP algorithm.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from megatron_longctx.attention import cp_attention
from megatron_longctx.attention.sinks import add_sink, sink_grad
from megatron_longctx.bench import harness


def _median_s(fn: Callable[[], None], repeats: int, device: torch.device) -> float:
    return harness.median_seconds(fn, repeats, device=device)


def measure(seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
            repeats: int, backend: str | None = None) -> dict:
    """One row: forward + backward seconds with and without sinks, and the sink's own work alone."""
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q = rand(seq, 1, heads, head_dim).requires_grad_()  # [s, b, h_q, d]
    k, v = (rand(seq, 1, kv_heads, head_dim).requires_grad_() for _ in range(2))  # [s, b, h_kv, d]
    dout = rand(seq, 1, heads, head_dim)
    sink = torch.zeros(heads, device=device, dtype=torch.float32, requires_grad=True)

    def step(offset):
        def run():
            out = cp_attention(q, k, v, None, algorithm="ring", backend=backend, softmax_offset=offset)
            out.backward(dout)
        return run

    out_b = rand(1, seq, heads, head_dim)  # [b, s, h, d_v]: the kernels' layout
    lse = torch.randn(1, heads, seq, generator=gen, device=device)  # [b, h, s]
    dout_b = rand(1, seq, heads, head_dim)

    def sink_only():
        new_out, new_lse = add_sink(out_b, lse, sink)
        sink_grad(dout_b, new_out, new_lse, sink)

    plain = _median_s(step(None), repeats, device)
    with_sink = _median_s(step(sink), repeats, device)
    alone = _median_s(sink_only, repeats, device)
    return {"seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(dtype),
            "device": str(device), "backend": backend, "attention_s": plain, "with_sinks_s": with_sink,
            "sink_alone_s": alone, "sink_share_pct": 100 * alone / plain,
            "difference_pct": 100 * (with_sink - plain) / plain}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[2048], help="sequence lengths (tokens on the rank)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="default: float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--backend", default=None, help="kernel backend (default: automatic)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    rows = [measure(s, args.heads, args.kv_heads, args.head_dim, dtype, device, args.repeats, args.backend)
            for s in args.seq]
    print(harness.table([("tokens", lambda r: r["seq"], "d"),
                         ("attention ms", lambda r: 1e3 * r["attention_s"], ".2f"),
                         ("with sinks ms", lambda r: 1e3 * r["with_sinks_s"], ".2f"),
                         ("sink alone ms", lambda r: 1e3 * r["sink_alone_s"], ".3f"),
                         ("sink share %", lambda r: r["sink_share_pct"], ".2f")], rows))
    if args.json:
        harness.write_json(args.json, {"meta": harness.environment(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
