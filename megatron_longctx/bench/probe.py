"""One benchmark measurement job, run under ``torchrun`` by :mod:`megatron_longctx.bench.regression`.

``python -m torch.distributed.run --nproc-per-node N -m megatron_longctx.bench.probe TASK.json`` trains
every (configuration, sequence length) point of the task for ``warmup + steps`` steps from the same
initialisation on the same global batches (Python standard-library text, byte tokens), and writes one
record per point to the task's ``out`` file (rewritten after every point, so a killed job keeps what it
measured).  With ``budget_bytes`` the per-rank memory budget is enforced: on CPU a sampling thread
ends the job with exit code :data:`~megatron_longctx.bench.memory_meter.EXIT_OVER_BUDGET` when the
resident memory added since the point began passes it; on GPU the caching allocator is capped with
``torch.cuda.set_per_process_memory_fraction`` and an out-of-memory error ends the job the same way.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import logging
import math
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist

from megatron_longctx.megatron import cpu_compat
from megatron_longctx.bench.configs import all_configs, streams_model_states, tiles_for
from megatron_longctx import data as data_mod
from megatron_longctx.bench.engine import GPTShape, OptimConfig, Trainer, device, median, preimport_megatron, run_steps
from megatron_longctx.bench.memory_meter import EXIT_OVER_BUDGET, over_budget_exit
from megatron_longctx.memory.accounting import rss_bytes
from megatron_longctx.procs import process_groups_released


# Local tokens of the job's warm-up point.  MKL keeps the packing buffers of its larger matrix products
# for the life of the process (about 3.5 MiB for the llama-h256 preset), and products of a few dozen tokens
# per rank do not make them: a warm-up that short leaves them to the first measured point of the job,
# whose base is measured before them, while every later point's base holds them already.  At 512
# tokens per rank the first point measures what the later ones do.
WARMUP_TOKENS_PER_RANK = 512


def model_flops_per_step(shape: GPTShape, tokens: int) -> float:
    """Model FLOPs of one training step (forward + backward, causal attention, no recompute counted)."""
    m = shape.model
    h, f, layers, s = m.hidden_size, m.ffn_hidden_size, m.num_layers, shape.seq_length
    kv = m.kv_channels * m.num_query_groups
    fc1 = m.glu * f  # SwiGLU's fc1 holds the gate and the up projection
    dense = layers * (h * (h + 2 * kv) + h * h + h * fc1 + f * h) + h * m.vocab_size  # weights used per token
    attention = layers * s * h  # causal QK^T and PV: 2·s·h multiply-adds per token, halved by the mask
    return 6.0 * tokens * (dense + attention)


def optimizer_of(task: dict[str, Any], config: Any) -> str:
    """Which optimizer a point trains with: ``distributed`` (Megatron's, the task's ``distributed_optimizer``),
    ``whole`` (Megatron's, every rank holding all of Adam's moments), or for a model-state row the off-device
    AdamW its streamer steps: ``off-device sharded`` (the task's ``distributed_optimizer``, which the plugin runs
    over the streamed states: each rank's share of the moments) or ``off-device``."""
    sharded = task.get("distributed_optimizer", False)
    if streams_model_states(config):
        return "off-device sharded" if sharded else "off-device"
    return "distributed" if sharded else "whole"


def _cap_gpu_memory(budget_bytes: int) -> None:
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total))


def measure_point(task: dict[str, Any], config_name: str, seq_length: int, dataset_prefix: str) -> dict[str, Any]:
    """Train one point; the record the benchmark reports for it."""
    configs = {c.name: c for c in all_configs(task["cp"])}
    variant = tiles_for(configs[config_name].variant, seq_length // configs[config_name].variant.context_parallel_size)
    shape = GPTShape.from_dict(task["shape"], seq_length)
    gbs = task["global_batch_size"] or dist.get_world_size() // variant.context_parallel_size
    steps = task["warmup"] + task["steps"]
    tokenizer = data_mod.ByteTokenizer()
    dataset = data_mod.build_gpt_dataset(dataset_prefix, seq_length, steps * gbs, task["seed"], tokenizer)
    gc.collect()
    base = rss_bytes()
    budget = task.get("budget_bytes")
    if budget and torch.cuda.is_available():
        torch.cuda.empty_cache()
        _cap_gpu_memory(budget)
    optimizer = optimizer_of(task, configs[config_name])
    sharded = optimizer in ("distributed", "off-device sharded")
    trainer = Trainer(shape, variant, OptimConfig(lr=task["lr"], distributed=sharded), gbs, task["seed"])
    live = None
    if task.get("trace_live"):  # what the step's peak is made of (bench.live_memory)
        from megatron_longctx.bench.live_memory import LiveTensors

        live = LiveTensors()
        live.watch(trainer.model)
    try:
        with live if live is not None else contextlib.nullcontext():
            results = run_steps(trainer, lambda step: data_mod.global_batch(dataset, step, gbs), 0, steps,
                                budget_bytes=None if torch.cuda.is_available() else budget, base_bytes=base)
        states = None if trainer.model_states is None else trainer.model_states.describe(trainer.optimizer)
    except torch.cuda.OutOfMemoryError:
        if budget:  # the capped allocator refused: this probe does not fit the budget
            over_budget_exit(torch.cuda.max_memory_allocated(), budget)
        raise
    finally:
        if live is not None:
            live.unwatch()
        trainer.close()
        del trainer
        gc.collect()
    peaks = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device())
    peaks[dist.get_rank()] = max(r.peak_bytes for r in results)
    dist.all_reduce(peaks)
    timed = results[task["warmup"]:] or results
    step_time = median([r.step_time_s for r in timed])
    cpu = torch.tensor([median([r.cpu_time_s for r in timed])], dtype=torch.float64, device=device())
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)  # the slowest rank's process CPU-seconds per step
    tokens = timed[0].tokens
    flops = model_flops_per_step(shape, tokens)
    traced = {} if live is None else {"live_peak_bytes": live.peak, "live_peak_by_label": live.peak_by_label}
    return {
        **traced, **({} if states is None else {"model_states": states}),
        "config": config_name, "seq_length": seq_length, "status": "ok", "global_batch_size": gbs,
        "optimizer": optimizer,
        "step_times_s": [r.step_time_s for r in timed], "step_time_s": step_time,
        "cpu_s_per_step": float(cpu.item()), "cpu_us_per_token": float(cpu.item()) / tokens * 1e6,
        "tokens_per_s": tokens / step_time, "model_tflops": flops / step_time / 1e12 / dist.get_world_size(),
        "peak_mem_bytes_per_rank": [int(p) for p in peaks], "peak_mem_bytes": int(peaks.max()),
        "losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results],
    }


def run_task(task: dict[str, Any]) -> list[dict[str, Any]]:
    streamed = {c.name for c in all_configs(task["cp"]) if streams_model_states(c)}
    preimport_megatron(model_states=bool(streamed & set(task["configs"])))
    records: list[dict[str, Any]] = []
    tokenizer = data_mod.ByteTokenizer()
    longest = max(task["seq_lengths"])
    needed = (task["warmup"] + task["steps"] + 1) * max(task["global_batch_size"] or 0, dist.get_world_size()) * longest
    prefix = data_mod.ensure_stdlib_dataset(task["data_dir"], max(4 << 20, 2 * needed), tokenizer)
    # One short untimed, unbudgeted point first: lazy initialisation (BLAS scratch, autograd and gloo
    # threads, Megatron's global buffers) then belongs to no measured point.
    warm = _safe_point(dict(task, budget_bytes=None, warmup=0, steps=1), task["configs"][0],
                       WARMUP_TOKENS_PER_RANK * task["cp"], prefix)
    if warm["status"] != "ok":  # the whole run refused (e.g. --bf16 where Megatron cannot): every point says so
        records = [dict(warm, config=name, seq_length=seq) for name in task["configs"] for seq in task["seq_lengths"]]
        if dist.get_rank() == 0:
            _write(task["out"], records)
        return records
    if task.get("search"):
        from megatron_longctx.bench.maxseq import run_in_job

        run_in_job(task["search"], lambda seq: _safe_point(task, task["configs"][0], seq, prefix),
                   task["progress"], dist.get_rank() == 0)
        return records
    skip = {(name, seq) for name, seq in task.get("skip", [])}
    for config_name in task["configs"]:
        for seq_length in sorted(task["seq_lengths"]):
            if (config_name, seq_length) in skip:
                continue
            records.append(_safe_point(task, config_name, seq_length, prefix))
            if dist.get_rank() == 0:
                _write(task["out"], records)
    return records


def _safe_point(task: dict[str, Any], config_name: str, seq_length: int, prefix: str) -> dict[str, Any]:
    """:func:`measure_point`, with an error of the configuration reported as its status; the process
    groups the point made are destroyed after it (each point sets Megatron's parallel state up anew)."""
    with process_groups_released():
        try:
            return measure_point(task, config_name, seq_length, prefix)
        except (RuntimeError, ValueError, AssertionError, NotImplementedError) as exc:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            message = str(exc).splitlines()[0][:300] if str(exc) else ""
            return {"config": config_name, "seq_length": seq_length,
                    "status": f"failed: {type(exc).__name__}: {message}"}


def _write(path: str, records: list[dict[str, Any]]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(records, f, indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    os.replace(tmp, path)


def _quiet_megatron() -> None:
    """Megatron's import-time and deprecation chatter (warnings, INFO logs) off; errors still show."""
    warnings.filterwarnings("ignore")
    logging.getLogger("megatron").setLevel(logging.ERROR)


def _init_process_group() -> None:
    """The default group of a probe under torchrun (NCCL with a GPU, else gloo)."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        task = json.load(f)
    _quiet_megatron()
    _init_process_group()
    try:
        with cpu_compat.enabled():
            run_task(task)
    finally:
        dist.destroy_process_group()
    return 0


__all__ = ["EXIT_OVER_BUDGET", "main", "measure_point", "model_flops_per_step", "run_task"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
