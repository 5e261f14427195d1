"""The peers side by side: DeepSpeed Ulysses, ALST's tiled MLP and tiled loss, torch's context_parallel.

    python -m megatron_longctx.bench.peers --out-dir runs/peers          (or: megatron-longctx bench peers)

Every measurement is a fresh process (a fresh pair of gloo ranks for attention) running one
implementation: a float64 check at a small shape (also the warm-up), then one forward + backward at the
measured shape; CPU-seconds (``time.process_time``, the slowest rank) and the peak resident memory the
call added, per rank; then the steady-state time, the median of the next calls in the same process.
``--rounds`` rounds alternate the order of the implementations (A B, then B A, ...) and the table
reports medians, the ratios ours / peer and the load average at the start of each row.  Then, per
shape, one more process (pair of ranks) runs every implementation in turn for
``--interleaved-rounds`` rounds, one call each per round, the order reversed every round: the ratio of
two calls of one round compares them under the same machine state, and the table gives the median of
those per-round ratios with their quartiles (a ratio whose quartiles straddle 1.0 is a tie on this
machine).  A peer that is not installed is a row ``unavailable: <reason>``.
See :mod:`megatron_longctx.bench.peer_cases` for the implementations.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Callable, Optional

from megatron_longctx import procs
from megatron_longctx.bench import harness
from megatron_longctx.bench import peer_cases as cases
from megatron_longctx.memory.accounting import RSS_TRACKS_TENSORS_ENV

SCHEMA = "megatron-longctx-peers/1"
# (ours, peer) pairs the table sets against each other
PAIRS = (("ours-ulysses", "deepspeed-ulysses"), ("ours-ring", "deepspeed-ulysses"),
         ("ours-tiled-mlp", "alst-tiled-mlp"), ("ours-tiled-loss", "alst-tiled-loss"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_longctx.bench.peers", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out-dir", default="runs/peers")
    p.add_argument("--rounds", type=int, default=5, help="fresh processes per implementation and shape (median)")
    p.add_argument("--attention-seqs", default="4096,8192", help="global sequence lengths of the attention cases")
    p.add_argument("--kv-heads", default="8,2", help="KV heads of the attention cases (8 query heads, d 64)")
    p.add_argument("--tiled-seqs", default="16384,32768", help="sequence lengths of the tiled MLP / loss cases")
    p.add_argument("--hidden-size", type=int, default=256, help="tiled cases: h (Llama proportions: ffn 3.5h, V 32h)")
    p.add_argument("--shards", type=int, default=16, help="tiles of both tiled implementations")
    p.add_argument("--interleaved-rounds", type=int, default=11,
                   help="rounds of the same-process interleaved timing per shape (0: none)")
    p.add_argument("--only", default=None, help="comma-separated implementations (default: all)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per process")
    return p


# ------------------------------------------------------------------------------------------ launching
def run_fresh(fn: Callable, case: dict, world: int, timeout: float) -> list[dict[str, Any]]:
    """``fn(case)`` on ``world`` fresh spawned ranks (gloo when ``world > 1``); each rank's dict, in rank order.

    A rank that raises or dies stops the run at once: its dict is ``{"status": "failed: ...", "traceback"}``,
    a rank stopped because of it says so, a rank without a result after ``timeout`` seconds says that.
    """
    try:
        return procs.spawn_ranks(world, fn, (case,), timeout=timeout)
    except procs.RankFailed as exc:
        out = []
        for r in range(world):
            if r in exc.results:
                out.append(exc.results[r])
            elif exc.timed_out:
                out.append({"status": f"failed: rank {r} gave no result within {timeout:.0f} s"})
            elif r == exc.rank:
                out.append({"status": f"failed: {(exc.error.splitlines() or [''])[0][:400]}",
                            "traceback": exc.traceback[-2000:]})
            else:
                out.append({"status": f"failed: stopped when rank {exc.rank} failed", "stopped": True})
        return out


# ------------------------------------------------------------------------------------------ cases
def case_list(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (implementation, shape) case, grouped so the implementations of one shape are adjacent."""
    only = {n.strip() for n in args.only.split(",")} if args.only else None
    out: list[dict[str, Any]] = []
    for seq in (int(x) for x in args.attention_seqs.split(",") if x.strip()):
        for hkv in (int(x) for x in args.kv_heads.split(",") if x.strip()):
            shape = {"kind": "attention", "seq": seq, "hq": 8, "hkv": hkv, "d": 64, "seed": 11}
            out += [dict(shape, impl=i) for i in cases.ATTENTION if not only or i in only]
    h = args.hidden_size
    for seq in (int(x) for x in args.tiled_seqs.split(",") if x.strip()):
        for kind, impls in (("tiled-mlp", cases.TILED_MLP), ("tiled-loss", cases.TILED_LOSS)):
            shape = {"kind": kind, "seq": seq, "hidden": h, "ffn": 7 * h // 2, "vocab": 32 * h,
                     "shards": args.shards, "seed": 5}
            out += [dict(shape, impl=i) for i in impls if not only or i in only]
    if not only or cases.TORCH_CP in only:
        out.append({"kind": "torch-cp", "impl": cases.TORCH_CP, "seq": cases.CHECK_SEQ, "hq": 8, "d": 64, "seed": 3})
    return out


SHAPE_KEYS = ("kind", "seq", "hq", "hkv", "d", "hidden", "ffn", "vocab", "shards")


def _shape_key(case: dict[str, Any]) -> tuple:
    return tuple(case.get(k) for k in SHAPE_KEYS)


def measure_all(all_cases: list[dict[str, Any]], rounds: int, timeout: float,
                log: Callable[[str], None] = print, interleaved_rounds: int = 0) -> list[dict[str, Any]]:
    """Each case ``rounds`` times in fresh processes, alternating the order within each shape, then (with
    ``interleaved_rounds``) the implementations of each shape interleaved in one process; one row per case."""
    rows: list[dict[str, Any]] = []
    groups: dict[tuple, list[dict]] = {}
    for case in all_cases:
        groups.setdefault(_shape_key(case), []).append(case)
    for group in groups.values():
        runs: dict[str, list[list[dict]]] = {c["impl"]: [] for c in group}
        load = _loadavg()
        unavailable = {c["impl"]: cases.peer_unavailable(c["impl"]) for c in group}
        for r in range(1 if group[0]["kind"] == "torch-cp" else rounds):
            order = group if r % 2 == 0 else group[::-1]
            for case in order:
                if unavailable[case["impl"]]:
                    continue
                fn, world = _entry(case["kind"])
                runs[case["impl"]].append(run_fresh(fn, case, world, timeout))
        interleaved = _interleaved(group, unavailable, interleaved_rounds, timeout)
        for case in group:
            rows.append(_row(case, runs[case["impl"]], unavailable[case["impl"]], load))
            if rows[-1]["status"] == "ok" and case["impl"] in interleaved:
                rows[-1]["cpu_s_interleaved"] = interleaved[case["impl"]]
            log(_row_line(rows[-1]))
    return rows


def _interleaved(group: list[dict], unavailable: dict[str, Optional[str]], rounds: int,
                 timeout: float) -> dict[str, Any]:
    """``{impl: [CPU-seconds of each round, the slowest rank]}`` from one :func:`.peer_cases.interleaved_rank`
    process (pair of ranks) over the available implementations of one shape; ``{impl: "failed: ..."}`` when it
    failed; empty when fewer than two can run or ``rounds`` is 0."""
    impls = [c["impl"] for c in group if not unavailable[c["impl"]]]
    if rounds < 1 or len(impls) < 2 or group[0]["kind"] == "torch-cp":
        return {}
    case = {k: v for k, v in group[0].items() if k != "impl"}
    run = run_fresh(cases.interleaved_rank, {**case, "impls": impls, "rounds": rounds}, _entry(case["kind"])[1],
                    timeout)
    failed = [rank for rank in run if "status" in rank]
    if failed:
        first = next((rank for rank in failed if not rank.get("stopped")), failed[0])
        return {impl: first["status"] for impl in impls}
    return {impl: [max(rank[impl][i] for rank in run) for i in range(rounds)] for impl in impls}


def _entry(kind: str) -> tuple[Callable, int]:
    return {"attention": (cases.attention_rank, 2), "tiled-mlp": (cases.tiled_rank, 1),
            "tiled-loss": (cases.tiled_rank, 1), "torch-cp": (cases.torch_cp_rank, 2)}[kind]


def _row(case: dict[str, Any], runs: list[list[dict]], unavailable: Optional[str], load: str) -> dict[str, Any]:
    row = {**case, "loadavg": load}
    if unavailable:
        return {**row, "status": f"unavailable: {unavailable}"}
    failed = [rank for run in runs for rank in run if "cpu_s" not in rank]
    if failed:  # the rank that raised, rather than one stopped because of it
        first = next((rank for rank in failed if not rank.get("stopped")), failed[0])
        return {**row, "status": first.get("status", "failed"), "traceback": first.get("traceback")}
    cpu = [max(rank["cpu_s"] for rank in run) for run in runs]  # the slowest rank of each run
    steady = [statistics.median(max(steps) for steps in zip(*(rank["cpu_s_steps"] for rank in run))) for run in runs]
    peaks = [[rank["peak_added_bytes"] for rank in run] for run in runs]
    return {**row, "status": "ok", "rounds": len(runs), "cpu_s": cpu, "cpu_s_median": statistics.median(cpu),
            "cpu_s_steady": steady, "cpu_s_steady_median": statistics.median(steady),
            "peak_mib_per_rank_median": [statistics.median(p[i] for p in peaks) / 2**20 for i in range(len(peaks[0]))],
            "peak_mib_median": statistics.median(max(p) for p in peaks) / 2**20,
            "max_rel_err_vs_float64": max(rank["max_rel_err"] for run in runs for rank in run)}


def pair_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ours / peer time and memory ratios for each :data:`PAIRS` pair at each shared shape."""
    by = {(r["impl"], _shape_key(r)): r for r in rows}
    out = []
    for ours, peer in PAIRS:
        for (impl, key), a in by.items():
            if impl != ours:
                continue
            b = by.get((peer, key))
            entry = {"ours": ours, "peer": peer, "kind": a["kind"], "seq": a["seq"], "hkv": a.get("hkv")}
            if b is None or a["status"] != "ok" or b["status"] != "ok":
                entry["status"] = (b or {}).get("status", "peer not measured") if a["status"] == "ok" else a["status"]
            else:
                entry.update(status="ok", time_ratio=a["cpu_s_median"] / b["cpu_s_median"],
                             time_ratio_steady=a["cpu_s_steady_median"] / b["cpu_s_steady_median"],
                             mem_ratio=a["peak_mib_median"] / max(b["peak_mib_median"], 1e-9),
                             **interleaved_ratio(a.get("cpu_s_interleaved"), b.get("cpu_s_interleaved")))
            out.append(entry)
    return out


def interleaved_ratio(ours: Any, peer: Any) -> dict[str, Any]:
    """The median and quartiles of the per-round ratios ours / peer of two interleaved timings (lists of
    CPU-seconds, one per round), and what they say: ``faster`` (the upper quartile is below 1), ``slower``
    (the lower quartile is above 1) or ``tie``; the failure text when a timing failed, nothing when absent."""
    if ours is None or peer is None:
        return {}
    if isinstance(ours, str) or isinstance(peer, str):
        return {"time_ratio_interleaved_status": ours if isinstance(ours, str) else peer}
    ratios = [a / b for a, b in zip(ours, peer)]
    q1, q3 = (statistics.quantiles(ratios, n=4, method="inclusive")[i] for i in (0, 2)) if len(ratios) > 1 \
        else (ratios[0], ratios[0])
    verdict = "faster" if q3 < 1.0 else "slower" if q1 > 1.0 else "tie"
    return {"time_ratio_interleaved": statistics.median(ratios), "time_ratio_interleaved_quartiles": [q1, q3],
            "time_ratio_interleaved_rounds": len(ratios), "time_ratio_interleaved_verdict": verdict}


def _interleaved_cell(p: dict[str, Any]) -> str:
    if "time_ratio_interleaved" in p:
        q1, q3 = p["time_ratio_interleaved_quartiles"]
        return f"{p['time_ratio_interleaved']:.3f} [{q1:.3f}–{q3:.3f}] {p['time_ratio_interleaved_verdict']}"
    return p.get("time_ratio_interleaved_status", "–")


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def _row_line(r: dict[str, Any]) -> str:
    shape = f"s={r['seq']}" + (f" hkv={r['hkv']}" if "hkv" in r else "") + (f" h={r['hidden']}" if "hidden" in r else "")
    if r["status"] != "ok":
        return f"  {r['impl']:<24} {shape:<18} {r['status']}"
    return (f"  {r['impl']:<24} {shape:<18} CPU {r['cpu_s_median']:.3f} s (steady {r['cpu_s_steady_median']:.3f})  "
            f"peak {r['peak_mib_median']:.1f} MiB/rank  err {r['max_rel_err_vs_float64']:.1e}  (load {r['loadavg']})")


def markdown(result: dict[str, Any]) -> str:
    lines = ["### Peers side by side (CPU, float32, fresh process per measurement)", "",
             f"Medians of {result['rounds']} alternating rounds; time = CPU-seconds of the first forward + backward "
             f"at the shape (slowest rank); steady = the median of the {cases.STEADY_STEPS} calls after it in the "
             "same process; memory = peak RSS the first call added per rank; error = max |x - x64| / max |x64| "
             "over output and gradients at a 512-token check shape.", "",
             "| implementation | case | seq | KV heads | CPU s | CPU s (steady) | peak MiB/rank | err vs float64 "
             "| load avg |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['impl']} | {r['kind']} | {r['seq']} | {r.get('hkv', '–')} | {r['status']} | | | | "
                         f"{r['loadavg']} |")
            continue
        lines.append(f"| {r['impl']} | {r['kind']} | {r['seq']} | {r.get('hkv', '–')} | {r['cpu_s_median']:.3f} "
                     f"| {r['cpu_s_steady_median']:.3f} | {r['peak_mib_median']:.1f} "
                     f"| {r['max_rel_err_vs_float64']:.1e} | {r['loadavg']} |")
    rounds = result.get("interleaved_rounds", 0)
    lines += ["", f"Interleaved: one process (pair of ranks) per shape, each implementation timed once per round for "
              f"{rounds} rounds, the order reversed every round; the median of the per-round ratios "
              "[lower–upper quartile]; a tie when the quartiles straddle 1.0.", "",
              "| ours / peer | seq | KV heads | time | time (steady) | time (interleaved) | peak memory |",
              "|---|---:|---:|---:|---:|---|---:|"]
    for p in result["pairs"]:
        if p["status"] != "ok":
            lines.append(f"| {p['ours']} / {p['peer']} | {p['seq']} | {p['hkv'] or '–'} | {p['status']} | | | |")
        else:
            lines.append(f"| {p['ours']} / {p['peer']} | {p['seq']} | {p['hkv'] or '–'} | {p['time_ratio']:.3f} "
                         f"| {p['time_ratio_steady']:.3f} | {_interleaved_cell(p)} | {p['mem_ratio']:.3f} |")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    if args.rounds < 1:
        raise ValueError(f"--rounds {args.rounds}: give at least 1 (5 or more to compare times)")
    for key, value in RSS_TRACKS_TENSORS_ENV.items():  # the spawned ranks inherit it: RSS follows live tensors
        os.environ.setdefault(key, value)
    if args.interleaved_rounds < 0:
        raise ValueError(f"--interleaved-rounds {args.interleaved_rounds}: give 0 (none) or more")
    rows = measure_all(case_list(args), args.rounds, args.timeout, log, args.interleaved_rounds)
    return {"schema": SCHEMA, "rounds": args.rounds, "interleaved_rounds": args.interleaved_rounds, "rows": rows,
            "pairs": pair_rows(rows)}


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    result = run(args)
    harness.write_json(os.path.join(args.out_dir, "peers.json"), result, default=lambda o: None)
    table = markdown(result)
    with open(os.path.join(args.out_dir, "peers.md"), "w") as f:
        f.write(table)
    print(table)
    print(f"wrote {os.path.join(args.out_dir, 'peers.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
