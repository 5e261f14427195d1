"""``megatron-longctx bench``: the plugin against baseline Megatron, side by side, in one run.

1. **Sweep**: every configuration of :func:`~megatron_longctx.bench.configs.default_configs` at every
   sequence length, from the same initialisation on the same global batches: median step time of
   several steps, tokens/s, model TFLOPS, peak memory per rank, and loss / grad-norm parity with the
   baseline at the same length.  One ``torchrun`` job measures the whole sweep.
2. **Max trainable sequence** under a per-rank memory budget: doubling then bisection, every probe a
   fresh ``torchrun`` job whose budget is *enforced* (CPU: the job dies when a rank's resident memory
   grows past the budget; GPU: ``set_per_process_memory_fraction``, an OOM is a failed probe).  The
   ratio plugin / baseline is the headline number (ALST, arXiv:2506.13996, reports 16× over its baseline).
3. **Output**: ``bench.json``, ``bench.md`` and PNG plots; with ``--compare previous.json`` the exit code is
   non-zero when a configuration got slower or hungrier beyond ``--tolerance``, or parity broke.

CPU timings are noisy: times are medians and compared as ratios to the baseline of the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Optional

from megatron_longctx import procs
from megatron_longctx.bench import compare as compare_mod
from megatron_longctx.bench import harness, report
from megatron_longctx.bench.configs import (FLASH_RECOMPUTE, REFERENCE, all_configs, baseline_configs, default_configs,
                                            select, streams_model_states, sweep_skip_reason, unavailable_reason)
from megatron_longctx.bench.engine import GPTShape
from megatron_longctx.bench.headline import headline_line, max_seq_headline, model_states_headline, model_states_line
from megatron_longctx.bench.maxseq import drive, search_max_seq
from megatron_longctx.data import ByteTokenizer, padded_vocab_size
from megatron_longctx.memory.accounting import RSS_TRACKS_TENSORS_ENV
from megatron_longctx.plan.model import ModelShape, param_counts

ENFORCEMENT_CPU = "enforced: a probe dies when a rank's resident memory grows past the budget"
ENFORCEMENT_GPU = "enforced: torch.cuda.set_per_process_memory_fraction; OOM = failure"
BUDGET_MARKER = "[memory budget]"


@dataclasses.dataclass(frozen=True)
class Preset:
    """A benchmark model (``--preset``) and the per-rank budget of its max-sequence search on the CPU."""

    model: ModelShape  # the planner's shape type; vocab_size is raised to the tokenizer's (bench_model)
    budget_mib: float  # float32; --bf16 adds 2 bytes per parameter (_default_budget_mib)


# The tokenizer's vocabulary: the project's ByteTokenizer (UTF-8 bytes of the Python standard library's
# sources, offline; ids < 258) padded to a multiple of 64.  Every model's output layer has at least these rows.
TOKENIZER_VOCAB = padded_vocab_size(ByteTokenizer())

# llama-h256: Llama proportions at hidden 256 (ffn = 3.5·h, vocabulary = 32·h as Llama-3's 128K at h = 4096),
# the headline's model; its output layer has 8,192 rows, as Megatron's NullTokenizer with --vocab-size 8192
# would give over the same bytes.  tiny: the tokenizer's own vocabulary.
_LLAMA_H256 = ModelShape(name="llama-h256", num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                         kv_channels=32, ffn_hidden_size=896, vocab_size=8192)
PRESETS: dict[str, Preset] = {p.model.name: p for p in (
    Preset(_LLAMA_H256, budget_mib=160.0),
    Preset(ModelShape(name="tiny", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                      kv_channels=16, ffn_hidden_size=256, vocab_size=TOKENIZER_VOCAB, activation="gelu",
                      normalization="LayerNorm", add_bias_linear=True), budget_mib=64.0),
    # llama-h256 at 8 layers: 11.0M parameters, 168 MiB of float32 weights, main gradients and Adam moments per
    # rank, 84% of its budget; the model-state rows' headline is measured on it
    Preset(dataclasses.replace(_LLAMA_H256, name="llama-states", num_layers=8), budget_mib=200.0),
)}
MAX_SEQ_DEFAULT = [c.name for c in baseline_configs(2)] + ["ring+all", "allgather+all"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-longctx bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc-per-node", type=int, default=2, help="ranks (the plugin runs CP = ranks)")
    p.add_argument("--output-dir", default="runs/bench")
    p.add_argument("--seq-lengths", default="1024,2048,4096", help="comma-separated sweep lengths")
    p.add_argument("--configs", default=None, help="comma-separated configuration names (default: all)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per point (the median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per point")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-h256",
                   help="model shape: llama-h256 (hidden 256, 4 layers, 8 heads / 2 KV groups, SwiGLU ffn 896, "
                        "RMSNorm, RoPE, untied output layer, vocabulary 8192), llama-states (the same at 8 layers: its "
                        "float32 weights, gradients and Adam moments are 84%% of its 200 MiB budget; the model-state "
                        "rows' model) or tiny (the fast 2-layer hidden-64 GELU model)")
    for flag in ("num-layers", "hidden-size", "num-attention-heads", "num-query-groups", "ffn-hidden-size",
                 "vocab-size"):
        p.add_argument(f"--{flag}", type=int, default=None, help="override the preset's value")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 mixed precision as Megatron's --bf16 (bf16 weights and activations, fp32 main grads, "
                        "master weights and Adam) for every configuration; the default budget grows by the 2 bytes "
                        "per parameter of the bf16 weights kept beside the fp32 master copy")
    p.add_argument("--no-distributed-optimizer", dest="distributed_optimizer", action="store_false",
                   help="each rank holds all of Adam's moments; by default every row but the model-state ones trains "
                        "with Megatron's distributed optimizer (--use-distributed-optimizer: the moments sharded over "
                        "the ranks), as a Megatron user at these ranks does")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--budget-mib", type=float, default=None,
                   help="per-rank memory budget of the max-sequence search (default on CPU: 160 for llama-h256, "
                        "200 for llama-states, 64 for tiny, each + 2 bytes per parameter with --bf16; "
                        "80%% of the GPU)")
    p.add_argument("--max-seq-configs", default=",".join(MAX_SEQ_DEFAULT),
                   help="configurations searched for max sequence (the headline is the best plugin one over the "
                        "strongest baseline one; the model-state rows ring+offload[+mlp]+states-<disk|host>, named "
                        "in --configs too, have their own headline over the same baselines)")
    p.add_argument("--max-seq-start", type=int, default=512, help="first probe length of the search")
    p.add_argument("--max-seq-cap", type=int, default=65536, help="longest length probed (CPU time is quadratic)")
    p.add_argument("--max-seq-resolution", type=float, default=0.1, help="bisection stops at this relative gap")
    p.add_argument("--skip-max-seq", action="store_true")
    p.add_argument("--time-check-rounds", type=int, default=5,
                   help="fresh jobs per side of the time-per-token check (best plugin vs megatron-flash+recompute "
                        "at that baseline's longest length); 0 skips it")
    p.add_argument("--time-check-seq", type=int, default=None,
                   help="length of the time-per-token check (default: megatron-flash+recompute's max sequence)")
    p.add_argument("--time-check-plugin", default="ring+all",
                   help="plugin configuration of the time check when no max-sequence search picked the best")
    p.add_argument("--peers", action="store_true",
                   help="also run the peers side by side (python -m megatron_longctx.bench.peers, its defaults) "
                        "and add them to the JSON and markdown")
    p.add_argument("--sweep-mem-limit-mib", type=float, default=2048,
                   help="the sweep skips megatron-unfused where its s x s scores alone would pass this per rank")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--compare", default=None, metavar="PREVIOUS_JSON", help="fail on regressions against this run")
    p.add_argument("--compare-recorded", nargs="?", const="recorded", default=None, metavar="RECORDED_JSON",
                   help="fail when a max sequence or the headline falls below the figures recorded in the repository "
                        "(megatron_longctx/bench/recorded.json, or this file)")
    p.add_argument("--tolerance", default="5%", help="allowed slowdown / memory growth for --compare")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per torchrun job")
    return p


# ----------------------------------------------------------------------------------------- launching
PROBE_ENV = {"PYTHONWARNINGS": "ignore"}


def run_probe_job(task: dict[str, Any], nproc: int, timeout: float) -> tuple[int, str, list[dict[str, Any]]]:
    """One probe job (see :mod:`megatron_longctx.bench.probe`) under torchrun: exit code (124 past
    ``timeout``), combined output, point records."""
    with tempfile.TemporaryDirectory(prefix="longctx-bench-") as tmp:
        task = dict(task, out=os.path.join(tmp, "records.json"))
        task_path = os.path.join(tmp, "task.json")
        with open(task_path, "w") as f:
            json.dump(task, f)
        rc, output = procs.torchrun("megatron_longctx.bench.probe", [task_path], nproc, timeout, PROBE_ENV,
                                    defaults=RSS_TRACKS_TENSORS_ENV)  # RSS tracks live tensors
        records = []
        if os.path.exists(task["out"]):
            with open(task["out"]) as f:
                records = json.load(f)
    return rc, output, records


def _tail(output: str, n: int = 3) -> str:
    lines = [l for l in output.splitlines() if l.strip() and "Warning" not in l]
    errors = [l for l in lines if "Error" in l or "error" in l]
    return " | ".join((errors or lines)[-n:])[-400:]


# ----------------------------------------------------------------------------------------- max sequence
def _max_seq(args: argparse.Namespace, base_task: dict[str, Any], configs: list[str], budget: int,
             log: Callable[[str], None]) -> dict[str, Any]:
    granularity = 128 * args.nproc_per_node
    results: dict[str, Any] = {}
    for name in configs:
        search = {"start": args.max_seq_start, "cap": args.max_seq_cap, "granularity": granularity,
                  "resolution": args.max_seq_resolution, "known": {}}
        task = dict(base_task, configs=[name], seq_lengths=[args.max_seq_cap], warmup=0, steps=1,
                    budget_bytes=budget, global_batch_size=0)
        start = time.perf_counter()

        def launch(search: dict[str, Any], progress: str, task: dict[str, Any] = task) -> tuple[int, str]:
            rc, output, _ = run_probe_job(dict(task, search=search, progress=progress), args.nproc_per_node,
                                          args.timeout)
            return rc, output

        log(f"  {name}:")
        with tempfile.TemporaryDirectory(prefix="longctx-maxseq-") as tmp:
            results[name] = drive(launch, search, os.path.join(tmp, "progress.json"), BUDGET_MARKER, log)
        probes = ", ".join(f"{p['seq_length']}{'' if p['ok'] else ' x'}" for p in results[name]["probes"])
        log(f"    max {results[name]['max_seq']} tokens{' (cap)' if results[name]['at_cap'] else ''}; "
            f"probes {probes} ({time.perf_counter() - start:.0f} s)")
    out: dict[str, Any] = {"budget_bytes": budget, "granularity": granularity, "cap": args.max_seq_cap,
                           "enforcement": ENFORCEMENT_GPU if _gpu() else ENFORCEMENT_CPU, "results": results,
                           "probes": "each in a fresh process, its base measured there after the warm-up"}
    return out


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# ----------------------------------------------------------------------------------------- main
def _meta(args: argparse.Namespace, shape: dict[str, Any]) -> dict[str, Any]:
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
    return harness.environment(device=device, world_size=args.nproc_per_node, shape=shape, preset=args.preset,
                               time_reference=FLASH_RECOMPUTE, steps=args.steps, warmup=args.warmup,
                               distributed_optimizer=args.distributed_optimizer)


def probe_task(args: argparse.Namespace, shape: dict[str, Any], data_dir: str, **fields: Any) -> dict[str, Any]:
    """What every probe job of a run shares (:mod:`.probe` reads it), from the benchmark's ``args``; ``fields``
    add to it or replace its values."""
    return {"cp": args.nproc_per_node, "shape": shape, "seed": args.seed, "lr": args.lr, "warmup": args.warmup,
            "steps": args.steps, "global_batch_size": args.nproc_per_node, "budget_bytes": None,
            "distributed_optimizer": args.distributed_optimizer, "data_dir": data_dir, **fields}


def _log(text: str) -> None:
    print(text, flush=True)


def run(args: argparse.Namespace, log: Callable[[str], None] = _log) -> dict[str, Any]:
    """The whole benchmark; returns the result dict (also written to ``--output-dir``)."""
    seqs = sorted({int(s) for s in str(args.seq_lengths).split(",") if s.strip()})
    if not seqs:
        raise ValueError("--seq-lengths: give at least one length, e.g. 1024,2048")
    cp = args.nproc_per_node
    bad = [s for s in seqs if s % (2 * cp)]
    if bad:
        raise ValueError(f"--seq-lengths {bad} are not multiples of 2 x CP ({2 * cp}); Megatron's CP split needs that")
    names = [n.strip() for n in args.configs.split(",")] if args.configs else None
    configs = select(default_configs(cp) if names is None else all_configs(cp), names)
    shape = model_shape(args)
    os.makedirs(args.output_dir, exist_ok=True)
    result: dict[str, Any] = {"schema": report.SCHEMA, "meta": _meta(args, shape), "configs": [], "sweep": []}
    runnable = []
    for c in configs:
        reason = unavailable_reason(c, cp, shape["num_query_groups"])
        result["configs"].append({**c.as_dict(), "status": "ok" if reason is None else f"unavailable: {reason}"})
        if reason is None:
            runnable.append(c.name)
        else:
            log(f"{c.name}: unavailable: {reason}")
    base_task = probe_task(args, shape, os.path.join(args.output_dir, "data"))
    start = time.perf_counter()
    log(f"sweep: {len(runnable)} configurations x {len(seqs)} lengths on {cp} ranks ...")
    by_name = {c.name: c for c in configs}
    skipped = [{"config": n, "seq_length": s, "status": why} for n in runnable for s in seqs
               if (why := sweep_skip_reason(by_name[n], shape, s, int(args.sweep_mem_limit_mib * 2**20)))]
    skip = [[r["config"], r["seq_length"]] for r in skipped]
    rc, output, records = run_probe_job(dict(base_task, configs=runnable, seq_lengths=seqs, skip=skip), cp,
                                        args.timeout)
    records += skipped
    measured = {(r["config"], r["seq_length"]) for r in records}
    for name in runnable:
        for seq in seqs:
            if (name, seq) not in measured:
                records.append({"config": name, "seq_length": seq,
                                "status": f"failed: sweep job exit {rc}: {_tail(output)}"})
    result["sweep"] = records
    report.annotate(result["sweep"], [REFERENCE, "megatron-flash"], FLASH_RECOMPUTE, bf16=shape["bf16"])
    log(f"sweep done in {time.perf_counter() - start:.0f} s")
    if not args.skip_max_seq:
        wanted = [n.strip() for n in args.max_seq_configs.split(",") if n.strip()]
        searched = [n for n in wanted if n in runnable]
        budget_mib = args.budget_mib or _default_budget_mib(args.preset, bench_model(args), shape["bf16"])
        budget = int(budget_mib * 2**20)
        log(f"max trainable sequence under {budget / 2**20:.0f} MiB/rank: {', '.join(searched)}")
        result["max_seq"] = _max_seq(args, base_task, searched, budget, log)
        streamed = {c.name for c in configs if streams_model_states(c)}
        roles = {c["name"]: c["role"] for c in result["configs"] if c["name"] not in streamed}
        result["max_seq"].update(max_seq_headline(result["max_seq"]["results"], roles, REFERENCE))
        states = model_states_headline(result["max_seq"]["results"], roles, streamed)
        if states is None or result["max_seq"]["best_plugin"]:  # else only model-state rows trained
            log(headline_line(result["max_seq"]))
        if states is not None:
            result["max_seq"]["model_states_headline"] = states
            log(model_states_line(states))
    check = _time_check_case(args, result, runnable)
    if check and args.time_check_rounds > 0:
        result["time_check"] = time_check(args, base_task, *check, log)
    return result


def _time_check_case(args: argparse.Namespace, result: dict[str, Any], runnable: list[str]) -> Optional[tuple]:
    """(plugin, baseline, length) of the time-per-token goal: the best plugin configuration against
    megatron-flash+recompute at that baseline's longest trainable length (or ``--time-check-seq``)."""
    ms = result.get("max_seq") or {}
    plugin = ms.get("best_plugin") or (args.time_check_plugin if args.time_check_plugin in runnable else None)
    seq = args.time_check_seq or (ms.get("results", {}).get(FLASH_RECOMPUTE) or {}).get("max_seq")
    if not plugin or not seq or FLASH_RECOMPUTE not in runnable:
        return None
    granularity = 2 * args.nproc_per_node
    return plugin, FLASH_RECOMPUTE, seq // granularity * granularity


def time_check(args: argparse.Namespace, base_task: dict[str, Any], plugin: str, baseline: str, seq: int,
               log: Callable[[str], None]) -> dict[str, Any]:
    """CPU-seconds per token of ``plugin`` over ``baseline`` at ``seq``: a fresh job per measurement,
    alternating (A B, B A, ...), ``--time-check-rounds`` each; medians."""
    samples: dict[str, list[float]] = {plugin: [], baseline: []}
    loads = []
    for r in range(args.time_check_rounds):
        for name in ((plugin, baseline) if r % 2 == 0 else (baseline, plugin)):
            loads.append(harness.loadavg())
            rc, output, records = run_probe_job(dict(base_task, configs=[name], seq_lengths=[seq], warmup=1, steps=1),
                                                args.nproc_per_node, args.timeout)
            ok = [rec for rec in records if rec.get("status") == "ok"]
            if not ok:
                return {"plugin": plugin, "baseline": baseline, "seq_length": seq,
                        "status": f"failed: {name} job exit {rc}: {_tail(output)}"}
            samples[name].append(ok[0]["cpu_us_per_token"])
    med = {k: statistics.median(v) for k, v in samples.items()}
    out = {"plugin": plugin, "baseline": baseline, "seq_length": seq, "status": "ok", "rounds": args.time_check_rounds,
           "cpu_us_per_token": samples, "median_cpu_us_per_token": med, "ratio": med[plugin] / med[baseline],
           "target": 1.3, "loadavg": loads}
    out["meets_target"] = out["ratio"] <= out["target"]
    log(f"time per token at {seq} tokens: {plugin} {med[plugin]:.0f} us / {baseline} {med[baseline]:.0f} us = "
        f"{out['ratio']:.2f}x (target <= 1.3x: {'met' if out['meets_target'] else 'not met'})")
    return out


def bench_model(args: argparse.Namespace) -> ModelShape:
    """The preset's model with the command line's overrides (``--hidden-size`` ...; the head dimension follows
    hidden / heads) and an output layer of at least the tokenizer's vocabulary."""
    model = PRESETS[args.preset].model
    overrides = {key: getattr(args, key) for key in ("num_layers", "hidden_size", "num_attention_heads",
                                                       "num_query_groups", "ffn_hidden_size", "vocab_size")
                 if getattr(args, key, None) is not None}
    model = dataclasses.replace(model, **overrides)
    return dataclasses.replace(model, kv_channels=max(1, model.hidden_size // model.num_attention_heads),
                               vocab_size=max(model.vocab_size, TOKENIZER_VOCAB))


def model_shape(args: argparse.Namespace) -> dict[str, Any]:
    """What a probe task carries as its ``shape`` (and ``bench.json`` as ``meta.shape``): the GPT of
    :func:`bench_model` with the run's dropout and ``--bf16``, without the length each point sets
    (:meth:`GPTShape.to_dict`); a ``ValueError`` names what the benchmark's GPT does not build."""
    return GPTShape(bench_model(args), bf16=bool(getattr(args, "bf16", False))).to_dict()


def _default_budget_mib(preset: str, model: ModelShape, bf16: bool) -> float:
    """The preset's per-rank budget; under bf16 the same room for activations as in float32: + 2 bytes per
    parameter (the bf16 weights beside the fp32 master copy; main grads and Adam are fp32 in both)."""
    import torch

    if torch.cuda.is_available():
        return 0.8 * torch.cuda.get_device_properties(0).total_memory / 2**20
    extra = 2 * param_counts(model).total / 2**20 if bf16 else 0.0
    return PRESETS[preset].budget_mib + extra


# Numeric flags and their lowest allowed value (inclusive); the resolution is a fraction below 1.
_AT_LEAST = {"nproc_per_node": 1, "steps": 1, "warmup": 0, "max_seq_start": 1, "max_seq_cap": 1,
             "time_check_rounds": 0, "time_check_seq": 1, "num_layers": 1, "hidden_size": 1,
             "num_attention_heads": 1, "num_query_groups": 1, "ffn_hidden_size": 1, "vocab_size": 1}
_POSITIVE = ("lr", "budget_mib", "sweep_mem_limit_mib", "timeout")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every numeric flag in range, or ``parser.error`` (exit 2) naming the flag and what it takes."""
    def bad(name: str, what: str) -> None:
        parser.error(f"--{name.replace('_', '-')} {getattr(args, name)!r}: {what}")

    for name, low in _AT_LEAST.items():
        value = getattr(args, name)
        if value is not None and value < low:
            bad(name, f"give an integer >= {low}")
    for name in _POSITIVE:
        value = getattr(args, name)
        if value is not None and not value > 0:
            bad(name, "give a number > 0")
    if not 0 < args.max_seq_resolution < 1:
        bad("max_seq_resolution", "give a fraction between 0 and 1 (e.g. 0.25)")
    if args.max_seq_cap < args.max_seq_start:
        bad("max_seq_cap", f"must be >= --max-seq-start ({args.max_seq_start})")
    try:
        lengths = [int(s) for s in str(args.seq_lengths).split(",") if s.strip()]
    except ValueError:
        lengths = [0]
    if not lengths or min(lengths) < 1:
        bad("seq_lengths", "give comma-separated positive integers, e.g. 1024,2048,4096")


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    check_args(parser, args)
    tolerance = compare_mod.parse_tolerance(args.tolerance)
    previous = None
    if args.compare:
        with open(args.compare) as f:
            previous = json.load(f)
        if previous.get("schema") != report.SCHEMA:
            raise ValueError(f"--compare {args.compare}: schema {previous.get('schema')!r}, expected {report.SCHEMA!r}")
    figures = None
    if args.compare_recorded:  # read before the run: a missing file fails at once
        figures = compare_mod.load_recorded(None if args.compare_recorded == "recorded" else args.compare_recorded)
    result = run(args)
    if args.peers:
        from megatron_longctx.bench import peers

        result["peers"] = peers.run(peers.build_parser().parse_args([]))
    findings = compare_mod.compare(result, previous, tolerance) if previous is not None else []
    if figures is not None:
        findings += compare_mod.compare_recorded(result, figures, tolerance)
        previous = previous if previous is not None else figures
    if previous is not None:
        result["regressions"] = [f.as_dict() for f in findings]
    os.makedirs(args.output_dir, exist_ok=True)
    json_path = os.path.join(args.output_dir, "bench.json")
    report.write_json(result, json_path)
    table = report.markdown(result)
    if result.get("peers"):
        from megatron_longctx.bench import peers

        table += "\n" + peers.markdown(result["peers"])
    with open(os.path.join(args.output_dir, "bench.md"), "w") as f:
        f.write(table)
    pngs = [] if args.no_plots else report.plots(result, args.output_dir)
    print(table)
    print(f"wrote {json_path}, {os.path.join(args.output_dir, 'bench.md')}" + "".join(f", {p}" for p in pngs))
    if previous is not None:
        for f in findings:
            print(f"REGRESSION: {f.message}")
        print(f"compared with {args.compare or 'the recorded figures'} at tolerance {tolerance * 100:.1f}%: "
              f"{len(findings)} regression(s)")
    broken = [p for p in result["sweep"] if p.get("parity_ok") is False]
    return 1 if findings or (previous is not None and broken) else 0


__all__ = ["build_parser", "main", "run", "search_max_seq"]

if __name__ == "__main__":
    sys.exit(main())
