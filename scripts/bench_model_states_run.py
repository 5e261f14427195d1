"""Peak RSS per rank and step time of a Llama-shaped model trained through ``megatron-longctx run`` at CP=2,
with its model states streamed to the host, to disk, or not at all.

    python scripts/bench_model_states_run.py [--layers 12 --hidden 1536 --ffn 4096 --heads 12 --groups 4
        --vocab 32000 --seq 512 --steps 3] [--bf16] [--distributed-optimizer] [--out bench_model_states_run.json]

Each mode is one ``megatron-longctx run`` (no baseline, no resume check, a checkpoint only after the last
step); the table is read from its ``metrics.jsonl``: the largest per-step peak RSS of any rank over the steps
after the first, the first step's (which also holds the start-up's: the model's build and DDP's), and the
median step time of the steps after the first.  Float32,
as the CPU trains (``--bf16``: Megatron's bf16 weights and float32 masters); the ratios are against ``none``,
the same run without the flag.  ``--distributed-optimizer`` adds Megatron's ``--use-distributed-optimizer`` to
every mode: Megatron's own for ``none``, the plugin's sharded off-device optimizer for the others.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("none", "host", "disk")


def _argv(a: argparse.Namespace, mode: str, out: str) -> list[str]:
    argv = [sys.executable, "-m", "megatron_longctx", "run", "--output-dir", out, "--data-dir", a.data_dir,
            "--no-baseline", "--no-resume-check", "--no-progress", "--nproc-per-node", "2",
            "--context-parallel-size", "2", "--train-iters", str(a.steps), "--save-interval", str(10 * a.steps),
            "--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--ffn-hidden-size", str(a.ffn),
            "--num-attention-heads", str(a.heads), "--group-query-attention", "--num-query-groups", str(a.groups),
            "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--vocab-size", str(a.vocab),
            "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq),
            "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-3", "--min-lr", "1e-5",
            "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if a.bf16:
        argv += ["--bf16"]
    if a.distributed_optimizer:
        argv += ["--use-distributed-optimizer"]
    if mode != "none":
        argv += ["--longctx-model-state-offload", mode, "--longctx-offload-host-pool-bytes", str(a.host_pool_bytes)]
    if mode == "disk":
        argv += ["--longctx-offload-disk-dir", os.path.join(out, "states")]
    return argv


def _one(a: argparse.Namespace, mode: str, root: str) -> dict:
    from megatron_longctx.memory.accounting import RSS_TRACKS_TENSORS_ENV

    out = os.path.join(root, mode)
    t = time.perf_counter()
    proc = subprocess.run(_argv(a, mode, out), capture_output=True, text=True,
                          env={**os.environ, **RSS_TRACKS_TENSORS_ENV})
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: megatron-longctx run exited {proc.returncode}\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        rows = [r for r in map(json.loads, fh) if r.get("run", "").startswith("plugin")]
    later = rows[1:] or rows
    return {"mode": mode, "steps": len(rows), "wall_s": time.perf_counter() - t,
            "peak_rss_gb_per_rank": max(max(r["peak_mem_bytes_per_rank"]) for r in later) / 1e9,
            "first_step_peak_rss_gb": max(rows[0]["peak_mem_bytes_per_rank"]) / 1e9,
            "step_s": statistics.median(r["step_time_s"] for r in later),
            "losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--bf16", action="store_true", help="bf16 weights, float32 masters (Megatron's --bf16)")
    p.add_argument("--distributed-optimizer", action="store_true",
                   help="Megatron's --use-distributed-optimizer in every mode (Adam's moments sharded over the ranks)")
    p.add_argument("--host-pool-bytes", type=int, default=8 << 30)
    p.add_argument("--root", default=None, help="run directories (default: a temporary directory)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="bench_model_states_run.json")
    a = p.parse_args()
    root = a.root or tempfile.mkdtemp(prefix="model-states-run-")
    a.data_dir = a.data_dir or os.path.join(root, "data")
    rows = [_one(a, mode, root) for mode in a.modes.split(",")]
    ref = next((r for r in rows if r["mode"] == "none"), None)
    print(f"{'mode':6} {'peak RSS/rank (GB)':>19} {'vs none':>8} {'first step (GB)':>16} {'vs none':>8} "
          f"{'step (s)':>9} {'vs none':>8}  losses")
    for r in rows:
        def vs(key: str) -> float:
            return r[key] / ref[key] if ref else float("nan")

        r["rss_vs_none"], r["first_step_vs_none"], r["step_vs_none"] = (
            vs("peak_rss_gb_per_rank"), vs("first_step_peak_rss_gb"), vs("step_s"))
        print(f"{r['mode']:6} {r['peak_rss_gb_per_rank']:19.2f} {r['rss_vs_none']:8.2f} "
              f"{r['first_step_peak_rss_gb']:16.2f} {r['first_step_vs_none']:8.2f} {r['step_s']:9.2f} "
              f"{r['step_vs_none']:8.2f}  " + " ".join(f"{x:.4f}" for x in r["losses"]))
    shape = {k: getattr(a, k) for k in ("layers", "hidden", "ffn", "heads", "groups", "vocab", "seq", "steps", "bf16",
                                        "distributed_optimizer")}
    with open(a.out, "w") as fh:
        json.dump({"shape": shape, "rows": rows}, fh, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
