"""The ranks' side of ``megatron-longctx eval``: Megatron's ``train`` replaced by a forward-only pass.

Megatron's ``pretrain`` parses the flags, builds the model with the main job's provider, loads the
checkpoint and builds the corpus iterator as for training; :func:`replace_train` then puts
:func:`evaluate` where ``train`` was, so no step, optimizer update or save happens.  The per-position
loss sums and the passkey counts are reduced over the ranks and rank 0 writes ``eval.json``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_longctx.job import passkey
from megatron_longctx.patching import Patch, patch


def replace_train(settings: dict[str, Any]) -> Patch:
    """Set ``megatron.training.training.train`` to the evaluation; returns the :class:`Patch` that undoes it."""
    from megatron.training import training

    def train(forward_step_func: Callable, model: Any, optimizer: Any, scheduler: Any, train_iterator: Any,
              *rest: Any, **kwargs: Any) -> tuple[int, float]:
        from megatron.training import get_args

        evaluate(model[0], train_iterator, settings)
        return get_args().iteration, 0.0

    return patch(training, "train", train, "megatron-longctx eval: a forward-only pass where Megatron trains")


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


def _cp_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state

    from megatron_longctx.megatron.batch import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank(batch, parallel_state.get_context_parallel_group())  # [b, s/cp]


def position_loss(model: Any, iterator: Any, settings: dict[str, Any]) -> dict[str, Any]:
    """Per-position loss sums over ``eval_batches`` batches, reduced over every rank, then binned."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    from megatron_longctx.job.providers import get_batch

    seq = settings["seq_length"]
    device = next(model.parameters()).device
    sums = torch.zeros(seq, dtype=torch.float64, device=device)
    counts = torch.zeros(seq, dtype=torch.float64, device=device)
    for _ in range(settings["eval_batches"] * get_num_microbatches()):
        batch = get_batch(iterator)  # [mbs, s/cp], zigzag-cut
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [mbs, s/cp]
        mask = batch["loss_mask"].to(torch.float64)
        pos = batch["position_ids"].reshape(-1)  # [mbs * s/cp]
        sums.index_add_(0, pos, (losses.to(torch.float64) * mask).reshape(-1))
        counts.index_add_(0, pos, mask.reshape(-1))
    dist.all_reduce(sums)
    dist.all_reduce(counts)
    per_token = (sums / counts.clamp_min(1)).tolist()
    edges = [round(i * seq / settings["position_bins"]) for i in range(settings["position_bins"] + 1)]
    bins = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        n = float(counts[lo:hi].sum())
        bins.append({"start": lo, "end": hi, "tokens": int(n), "loss": float(sums[lo:hi].sum()) / max(n, 1.0)})
    return {"bins": bins, "per_token": per_token, "mean": float(sums.sum() / counts.sum().clamp_min(1))}


def _digits_right(model: Any, prompt: passkey.Passkey, device: torch.device) -> int:
    """Teacher-forced greedy: how many answer tokens are the argmax of the logits one position before them."""
    from megatron.core import parallel_state

    tokens = torch.tensor([prompt.tokens], dtype=torch.long, device=device)  # [1, L]
    positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0)  # [1, L]
    local = _cp_batch({"tokens": tokens, "position_ids": positions})
    logits = model(local["tokens"], local["position_ids"], None)  # [1, L/cp, V]
    pos = local["position_ids"][0]  # [L/cp]
    lo, hi = prompt.answer
    asks = (pos >= lo - 1) & (pos < hi - 1)  # positions whose next token is an answer token
    predicted = logits[0, asks].argmax(-1)
    wanted = tokens[0, pos[asks] + 1]
    found = torch.tensor([float((predicted == wanted).sum()), float(asks.sum())], dtype=torch.float64, device=device)
    dist.all_reduce(found, group=parallel_state.get_context_parallel_group())
    assert int(found[1]) == hi - lo, (found, prompt.answer)  # every answer token was asked once
    return int(found[0])


def passkey_accuracy(model: Any, settings: dict[str, Any]) -> dict[str, Any]:
    device = next(model.parameters()).device
    lengths, depths, trials = settings["passkey_lengths"], settings["passkey_depths"], settings["passkey_trials"]
    accuracy, digits, keys = [], [], []
    for length in lengths:
        row, digit_row = [], []
        for depth in depths:
            hits = right = 0
            for trial in range(trials):
                prompt = passkey.make(length, depth, seed=1000 * trial + 17)
                n = _digits_right(model, prompt, device)
                hits, right = hits + (n == passkey.DIGITS), right + n
                keys.append({"length": length, "depth": depth, "key": prompt.key})
            row.append(hits / trials)
            digit_row.append(right / (trials * passkey.DIGITS))
        accuracy.append(row)
        digits.append(digit_row)
    return {"lengths": lengths, "depths": depths, "trials": trials, "accuracy": accuracy, "digit_accuracy": digits,
            "keys": keys}


def _peaks() -> list[int]:
    """Each rank's peak memory: device memory allocated on a GPU, resident memory on the CPU (the process's own
    footprint included)."""
    from megatron_longctx.memory.accounting import peak_rss_bytes

    cuda = torch.cuda.is_available()
    t = torch.zeros(dist.get_world_size(), dtype=torch.int64, device="cuda" if cuda else "cpu")
    t[dist.get_rank()] = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()  # [world]
    dist.all_reduce(t)
    return [int(x) for x in t]


def evaluate(model: Any, iterator: Any, settings: dict[str, Any]) -> None:
    model.eval()
    start = time.perf_counter()
    with torch.no_grad():
        result = {"checkpoint": settings["checkpoint"], "iteration": settings["iteration"],
                  "seq_length": settings["seq_length"], "context_parallel_size": settings["context_parallel_size"],
                  "attention": settings["attention"], "world_size": dist.get_world_size(),
                  "position_loss": position_loss(model, iterator, settings),
                  "passkey": passkey_accuracy(model, settings)}
    result["seconds"] = time.perf_counter() - start
    result["peak_mem_bytes_per_rank"] = _peaks()
    if dist.get_rank() == 0:
        with open(settings["output"], "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
