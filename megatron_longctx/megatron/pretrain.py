"""The main job: long-context GPT training on Megatron-Core with the plugin's context parallelism.

``megatron-longctx run`` (``make run``) with no arguments trains a small GPT (2 layers, hidden 64) on
8K-token sequences of Python's own standard-library sources, byte-level tokens, with
ContextParallelAttention at CP=2 on 2 ranks (gloo on CPU, NCCL and the GPU kernels on GPUs).  It
shows progress, logs loss / tokens per second / memory per rank, writes ``metrics.jsonl``, saves a
checkpoint half-way with Megatron's ``dist_checkpointing`` and checks that a fresh model resumed from
it reproduces the next step, and finally trains baseline Megatron (local attention, CP=1 — Megatron's
local attention refuses CP>1 without Transformer Engine) on the same global batches from the same
initialisation and compares the loss curves and the memory per rank.

Launch: without ``torchrun``'s environment the command starts ``python -m torch.distributed.run
--nproc-per-node N -m megatron_longctx.megatron.pretrain ARGS`` itself; under ``torchrun`` it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_longctx import cpu_compat
from megatron_longctx.megatron import data as data_mod
from megatron_longctx.megatron.training import (ModelShape, OptimConfig, StepResult, Trainer, Variant, device,
                                                preimport_megatron, rss_bytes, run_steps)

LOSS_RTOL = 1e-3  # float32 across a different attention split and reduction order, after Adam steps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-longctx run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("launch")
    g.add_argument("--nproc-per-node", type=int, default=2, help="ranks to start when not under torchrun")
    g.add_argument("--output-dir", default="runs/main", help="metrics.jsonl, summary.json and checkpoints go here")
    g.add_argument("--data-dir", default=None, help="indexed dataset cache (default: OUTPUT_DIR/../data)")
    g.add_argument("--data-max-bytes", type=int, default=4 << 20, help="bytes of stdlib sources in the corpus")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=2)
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--ffn-hidden-size", type=int, default=256)
    g.add_argument("--seq-length", type=int, default=8192)
    g.add_argument("--dropout", type=float, default=0.0)
    g = p.add_argument_group("training")
    g.add_argument("--train-steps", type=int, default=24)
    g.add_argument("--global-batch-size", type=int, default=2)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=0.0,
                   help="gradient clipping (Megatron's clip asserts CUDA grads: keep 0 on CPU)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--context-parallel-size", type=int, default=2)
    g.add_argument("--cp-comm-type", default="p2p", choices=["p2p", "all_gather", "a2a"],
                   help="Megatron's --cp-comm-type; the plugin's algorithm follows it unless "
                        "--longctx-cp-algorithm says otherwise")
    g.add_argument("--save-interval", type=int, default=None, help="checkpoint every N steps (default: half-way)")
    g.add_argument("--load", default=None, help="resume from this checkpoint directory")
    g.add_argument("--no-resume-check", action="store_true", help="skip reloading the checkpoint to check resume")
    g.add_argument("--no-baseline", action="store_true", help="skip the baseline Megatron comparison run")
    g.add_argument("--baseline-steps", type=int, default=8,
                   help="steps of the baseline comparison run (its attention is quadratic in memory and time)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    try:
        from megatron_longctx.megatron.args import add_longctx_args

        add_longctx_args(p)
    except ImportError as exc:  # the integration module is missing: plugin options are unavailable
        p.set_defaults(_longctx_unavailable=str(exc))
    return p


def _longctx_options(args: argparse.Namespace) -> tuple:
    """The non-default ``--longctx-*`` options as ``((field, value), ...)`` for :class:`Variant`."""
    from megatron_longctx.config import LongContextConfig
    from megatron_longctx.megatron.args import config_from_args

    chosen, default = config_from_args(args).flat(), LongContextConfig().flat()
    return tuple((k, v) for k, v in chosen.items() if v != default[k])


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launch(argv: list[str], nproc: int, env: Optional[dict[str, str]] = None) -> int:
    """``python -m torch.distributed.run --nproc-per-node nproc -m megatron_longctx.megatron.pretrain argv``."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={port}", "-m", "megatron_longctx.megatron.pretrain", *argv]
    child_env = dict(os.environ, **(env or {}))
    child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    child_env.setdefault("PYTHONWARNINGS", "ignore")
    return subprocess.call(cmd, env=child_env)


# ---------------------------------------------------------------------------------------------- worker
@dataclasses.dataclass
class RunLog:
    """Steps of one run, per-rank peak memory, and where the metrics go."""

    name: str
    steps: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def add(self, result: StepResult, peaks: list[int], metrics_path: str) -> dict[str, Any]:
        row = {"run": self.name, "step": result.step + 1, "loss": result.loss, "grad_norm": result.grad_norm,
               "step_time_s": result.step_time_s, "tokens": result.tokens,
               "tokens_per_s": result.tokens / result.step_time_s, "peak_mem_bytes_per_rank": peaks,
               "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        self.steps.append(row)
        if dist.get_rank() == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        return row


def _gather_peaks(peak: int) -> list[int]:
    t = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device())  # NCCL reduces device tensors
    t[dist.get_rank()] = peak
    dist.all_reduce(t)
    return [int(x) for x in t]


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled or dist.get_rank() != 0:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, file=sys.stdout)


def _train(trainer: Trainer, dataset: Any, log: RunLog, start: int, stop: int, args: argparse.Namespace,
           base_rss: int, save_at: Optional[int] = None) -> None:
    metrics = os.path.join(args.output_dir, "metrics.jsonl")
    bar = _progress(stop - start, log.name, not args.no_progress)

    def on_step(result: StepResult) -> None:
        row = log.add(result, _gather_peaks(result.peak_bytes), metrics)
        mem = max(row["peak_mem_bytes_per_rank"]) / 2**20
        text = f"loss {row['loss']:.4f}  tok/s {row['tokens_per_s']:.0f}  mem/rank {mem:.0f} MiB"
        if bar is not None:
            bar.set_postfix_str(text)
            bar.update(1)
        elif dist.get_rank() == 0:
            print(f"[{log.name}] step {row['step']}/{stop}  {text}", flush=True)
        if save_at is not None and result.step + 1 == save_at:
            trainer.save(_ckpt_dir(args), save_at)
            if dist.get_rank() == 0:
                _say(bar, f"[{log.name}] checkpoint after step {save_at} -> {_ckpt_dir(args)}")

    def batches(step: int) -> dict[str, torch.Tensor]:
        return data_mod.global_batch(dataset, step, args.global_batch_size)

    run_steps(trainer, batches, start, stop, on_step=on_step, base_bytes=base_rss)
    if bar is not None:
        bar.close()


def _say(bar: Any, text: str) -> None:
    (bar.write if bar is not None else print)(text)


def _ckpt_dir(args: argparse.Namespace) -> str:
    return os.path.join(args.output_dir, "checkpoint")


def _shape(args: argparse.Namespace) -> ModelShape:
    tokenizer = data_mod.ByteTokenizer()
    return ModelShape(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                      ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
                      vocab_size=data_mod.padded_vocab_size(tokenizer), dropout=args.dropout)


def _optim(args: argparse.Namespace) -> OptimConfig:
    return OptimConfig(lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad)


def _plugin_variant(args: argparse.Namespace) -> Variant:
    if getattr(args, "_longctx_unavailable", None):
        raise RuntimeError(f"the plugin is unavailable: {args._longctx_unavailable}")
    return Variant(name=f"plugin-cp{args.context_parallel_size}", context_parallel_size=args.context_parallel_size,
                   plugin=True, longctx_options=_longctx_options(args), cp_comm_type=args.cp_comm_type)


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """The job on this rank (process group up); returns the summary (identical on every rank)."""
    shape, optim = _shape(args), _optim(args)
    steps, gbs = args.train_steps, args.global_batch_size
    save_at = args.save_interval or max(1, steps // 2)
    preimport_megatron()
    base_rss = rss_bytes()  # memory per rank = what the run adds to the loaded libraries
    os.makedirs(args.output_dir, exist_ok=True)
    summary: dict[str, Any] = {"shape": dataclasses.asdict(shape), "world_size": dist.get_world_size(),
                               "global_batch_size": gbs, "train_steps": steps, "device": str(_device_name())}
    with cpu_compat.enabled():
        tokenizer = data_mod.ByteTokenizer()
        data_dir = args.data_dir or os.path.join(os.path.dirname(os.path.abspath(args.output_dir)), "data")
        prefix = data_mod.ensure_stdlib_dataset(data_dir, args.data_max_bytes, tokenizer)
        dataset = data_mod.build_gpt_dataset(prefix, shape.seq_length, (steps + 1) * gbs, args.seed, tokenizer)
        summary["dataset"] = {"prefix": prefix, "samples": len(dataset), "tokenizer": "byte-level (258: 256 bytes "
                              "+ eod + pad), offline", "text": "Python standard-library sources"}
        variant = _plugin_variant(args)
        plugin_log = RunLog(variant.name)
        trainer = Trainer(shape, variant, optim, gbs, args.seed)
        summary["plugin"] = {"variant": _variant_dict(variant), "init_checksum": trainer.parameter_checksum()}
        start = trainer.load(args.load) if args.load else 0
        _train(trainer, dataset, plugin_log, start, steps, args, base_rss, save_at=save_at if save_at < steps else None)
        summary["plugin"].update(_run_summary(plugin_log), fallbacks=dict(trainer.fallbacks))
        trainer.close()
        if not args.no_resume_check and save_at < steps and start < save_at:
            summary["resume"] = _resume_check(args, shape, variant, optim, dataset, plugin_log, save_at, base_rss)
        if not args.no_baseline:
            summary["baseline"] = _baseline(args, shape, optim, dataset, base_rss)
            summary["comparison"] = _compare(plugin_log.steps, summary["baseline"])
    if dist.get_rank() == 0:
        with open(os.path.join(args.output_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(render_summary(summary), flush=True)
    return summary


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"


def _variant_dict(variant: Variant) -> dict[str, Any]:
    d = dataclasses.asdict(variant)
    d["longctx_options"] = {k: v for k, v in variant.longctx_options}
    return d


def _run_summary(log: RunLog) -> dict[str, Any]:
    from statistics import median

    times = [r["step_time_s"] for r in log.steps[1:]] or [r["step_time_s"] for r in log.steps]
    return {"steps": log.steps, "median_step_time_s": median(times),
            "median_tokens_per_s": log.steps[0]["tokens"] / median(times) if log.steps else None,
            "peak_mem_bytes_per_rank": [max(r["peak_mem_bytes_per_rank"][i] for r in log.steps)
                                        for i in range(dist.get_world_size())] if log.steps else []}


def _resume_check(args: argparse.Namespace, shape: ModelShape, variant: Variant, optim: OptimConfig, dataset: Any,
                  log: RunLog, save_at: int, base_rss: int) -> dict[str, Any]:
    """A fresh model loaded from the checkpoint must reproduce the step right after it."""
    trainer = Trainer(shape, variant, optim, args.global_batch_size, args.seed + 1)  # other init: load must win
    loaded_step = trainer.load(_ckpt_dir(args))
    trainer.seed = args.seed
    result = trainer.step(loaded_step, data_mod.global_batch(dataset, loaded_step, args.global_batch_size))
    trainer.close()
    original = next(r for r in log.steps if r["step"] == loaded_step + 1)
    diff = abs(result.loss - original["loss"])
    ok = diff <= 1e-6 * max(1.0, abs(original["loss"]))
    if dist.get_rank() == 0:
        print(f"[resume] reloaded step {loaded_step}; step {loaded_step + 1} loss {result.loss:.6f} vs "
              f"{original['loss']:.6f} uninterrupted ({'identical' if ok else 'MISMATCH'}, |diff| {diff:.2e})",
              flush=True)
    return {"checkpoint": _ckpt_dir(args), "loaded_step": loaded_step, "resumed_loss": result.loss,
            "uninterrupted_loss": original["loss"], "abs_diff": diff, "ok": ok}


def _baseline(args: argparse.Namespace, shape: ModelShape, optim: OptimConfig, dataset: Any,
              base_rss: int) -> dict[str, Any]:
    variant = Variant(name="baseline-cp1")
    log = RunLog(variant.name)
    trainer = Trainer(shape, variant, optim, args.global_batch_size, args.seed)
    checksum = trainer.parameter_checksum()
    _train(trainer, dataset, log, 0, min(args.baseline_steps, args.train_steps), args, base_rss)
    out = {"variant": _variant_dict(variant), "init_checksum": checksum, **_run_summary(log),
           "fallbacks": dict(trainer.fallbacks)}
    trainer.close()
    return out


def _compare(plugin_steps: list[dict[str, Any]], baseline: dict[str, Any]) -> dict[str, Any]:
    base = {r["step"]: r for r in baseline["steps"]}
    pairs = [(r, base[r["step"]]) for r in plugin_steps if r["step"] in base]
    rel = [abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-12) for a, b in pairs]
    return {"steps_compared": len(pairs), "max_rel_loss_diff": max(rel) if rel else None,
            "loss_rtol": LOSS_RTOL, "losses_agree": bool(rel) and max(rel) <= LOSS_RTOL}


def render_summary(summary: dict[str, Any]) -> str:
    """The closing report: loss curves side by side, memory per rank and throughput."""
    lines = ["", "=" * 78, "megatron-longctx run: summary", "=" * 78]
    plugin, baseline = summary.get("plugin", {}), summary.get("baseline")
    lines.append(f"device {summary['device']}, {summary['world_size']} ranks, seq {summary['shape']['seq_length']}, "
                 f"global batch {summary['global_batch_size']}, {summary['train_steps']} steps")
    if baseline:
        lines.append(f"{'step':>5} {'plugin loss':>12} {'baseline loss':>14} {'rel diff':>10}")
        base = {r["step"]: r for r in baseline["steps"]}
        for r in plugin.get("steps", []):
            b = base.get(r["step"])
            if b is not None:
                lines.append(f"{r['step']:>5} {r['loss']:>12.5f} {b['loss']:>14.5f} "
                             f"{abs(r['loss'] - b['loss']) / abs(b['loss']):>10.2e}")
    rows = [("plugin", plugin)] + ([("baseline", baseline)] if baseline else [])
    lines.append("")
    lines.append(f"{'run':<10} {'CP':>3} {'median step s':>14} {'tokens/s':>10} {'peak MiB/rank':>22}")
    for name, run in rows:
        if run.get("steps"):
            peaks = "/".join(f"{p / 2**20:.0f}" for p in run["peak_mem_bytes_per_rank"])
            lines.append(f"{name:<10} {run['variant']['context_parallel_size']:>3} {run['median_step_time_s']:>14.3f} "
                         f"{run['median_tokens_per_s']:>10.0f} {peaks:>22}")
    if baseline and plugin.get("steps"):
        c = summary["comparison"]
        ratio = max(baseline["peak_mem_bytes_per_rank"]) / max(1, max(plugin["peak_mem_bytes_per_rank"]))
        lines.append(f"loss curves {'agree' if c['losses_agree'] else 'DIFFER'}: max rel diff "
                     f"{c['max_rel_loss_diff']:.2e} over {c['steps_compared']} steps (tolerance {c['loss_rtol']:.0e}); "
                     f"same init: {abs(plugin['init_checksum'] - baseline['init_checksum']) < 1e-6}")
        lines.append(f"peak memory per rank: baseline / plugin = {ratio:.2f}x")
    if "resume" in summary:
        r = summary["resume"]
        lines.append(f"resume from step {r['loaded_step']}: {'reproduces' if r['ok'] else 'DOES NOT reproduce'} "
                     f"the next step (|diff| {r['abs_diff']:.1e})")
    for name, run in rows:
        for what, why in run.get("fallbacks", {}).items():
            lines.append(f"note ({name}): {what}: {why}")
    return "\n".join(lines)


def quiet_megatron() -> None:
    """Megatron's import-time and deprecation chatter (warnings, INFO logs) off; errors still show."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)


def _init_process_group() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if not under_torchrun():
        if args.load is None:  # a fresh run: the half-way checkpoint of an earlier run must not linger
            shutil.rmtree(_ckpt_dir(args), ignore_errors=True)
        os.makedirs(args.output_dir, exist_ok=True)
        metrics = os.path.join(args.output_dir, "metrics.jsonl")
        if os.path.exists(metrics):
            os.remove(metrics)
        start = time.perf_counter()
        rc = launch(argv, args.nproc_per_node)
        print(f"megatron-longctx run: exit {rc} after {time.perf_counter() - start:.0f} s; metrics in {metrics}")
        return rc
    os.makedirs(args.output_dir, exist_ok=True)
    quiet_megatron()
    _init_process_group()
    try:
        summary = run_worker(args)
    finally:
        dist.destroy_process_group()
    ok = summary.get("resume", {}).get("ok", True) and summary.get("comparison", {}).get("losses_agree", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
