"""Shared pieces of scripts/gpu_check.py: problem sizes, time budgets, timing and error helpers."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch


class Skip(Exception):
    """A section cannot run here (a package it needs is absent); the message says why.  Status
    ``"unavailable"``: the section did not pass."""


class BudgetSkip(Skip):
    """A section ran out of its time budget before covering what it must.  Status ``"incomplete"``: the
    section did not pass."""


# Section and row statuses.  Only "ok" passes; every other one fails the run and the smoke test.
OK, FAILED, ERROR, INCOMPLETE, UNAVAILABLE = "ok", "failed", "error", "incomplete", "unavailable"
BUDGET = "budget_skipped"  # a case or row the time budget left out


def verdict(items: list[dict], must: int) -> str:
    """A section's status from its rows/cases (each with a ``status``): ``"ok"`` only when ``must`` of them
    ran and every one passed (``"ok"``, or ``"unsupported"`` where a backend's ``check`` refused the case
    with a reason); a failure or error wins over a budget skip."""
    statuses = [r.get("status") for r in items]
    if any(s in (FAILED, ERROR, "mismatch") for s in statuses):
        return FAILED
    if len(items) < must or any(s in (BUDGET, INCOMPLETE) for s in statuses):
        return INCOMPLETE
    return OK if all(s in (OK, "unsupported") for s in statuses) else FAILED


@dataclasses.dataclass
class Budget:
    seconds: float
    start: float = dataclasses.field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Problem sizes: real ones on a GPU, tiny ones for the CPU dry run."""

    kernel_timing_seq: int
    ring_tokens: int
    ring_sizes: tuple
    heads: tuple  # (hq, hkv, d) for kernel timing and the ring
    offload_model: dict  # GPTModel shape of the offload section
    offload_seq: int
    gpt_model: dict  # the tiny GPTModel of the CP=1 training step
    gpt_seq: int
    stack: dict  # max_seq model shape
    seq_start: int
    seq_cap: int
    seq_granularity: int
    numerics_seq: int  # sequence of max_seq's numerics check (all features against none)
    tiled_numerics_seq: int  # tiled_replay's float32 check (on gpt_model)
    tiled_model: dict  # tiled_replay's peak-memory model: a small vocabulary, so the layers set the peak
    tiled_memory_seq: int
    packed_lengths: tuple  # the packed section's documents (real tokens each)
    packed_heads: tuple  # (hq, hkv, d)
    packed_window: int  # its sliding window (left keys)
    packed_cp: tuple  # ring sizes it simulates


_LLAMA3_8B = dict(num_layers=2, hidden_size=4096, num_attention_heads=32, num_query_groups=8, kv_channels=128,
                  ffn_hidden_size=14336, vocab_size=128256)
GPU_SIZES = Sizes(
    kernel_timing_seq=16384, ring_tokens=65536, ring_sizes=(2, 4, 8), heads=(32, 8, 128),
    offload_model=dict(num_layers=4, hidden_size=2048, num_attention_heads=16, num_query_groups=8, kv_channels=128,
                       ffn_hidden_size=5632, vocab_size=32000),
    offload_seq=16384,
    gpt_model=dict(num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=4, kv_channels=32,
                   ffn_hidden_size=512, vocab_size=1024),
    gpt_seq=2048,
    stack=_LLAMA3_8B, seq_start=65536, seq_cap=1 << 23, seq_granularity=16384, numerics_seq=8192,
    tiled_numerics_seq=4096,  # several key blocks (attention.tiled.KEY_BLOCK) for the last query tiles
    tiled_model=dict(num_layers=8, hidden_size=1024, num_attention_heads=8, num_query_groups=4, kv_channels=128,
                     ffn_hidden_size=2816, vocab_size=1024),
    tiled_memory_seq=32768,
    # 24 documents, 64 to 5,000 tokens (1 to 40 kernel tiles of 128 rows), 40K tokens
    packed_lengths=(3000, 700, 129, 5000, 1800, 64, 2500, 400) * 3, packed_heads=(16, 4, 128), packed_window=1000,
    packed_cp=(2, 4, 8),
)
_TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
             ffn_hidden_size=128, vocab_size=256)
CPU_SIZES = Sizes(
    kernel_timing_seq=128, ring_tokens=256, ring_sizes=(2, 4, 8), heads=(4, 2, 16),
    offload_model=_TINY, offload_seq=64, gpt_model=_TINY, gpt_seq=64,
    stack=_TINY, seq_start=64, seq_cap=256, seq_granularity=32, numerics_seq=64,
    tiled_numerics_seq=64, tiled_model=_TINY, tiled_memory_seq=64,
    packed_lengths=(40, 9, 70, 1, 23, 56, 16, 33), packed_heads=(4, 2, 16), packed_window=12, packed_cp=(2, 4),
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, reps: int = 3) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _nonfinite_mismatch(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Where the reference ``b`` is finite, ``a`` must be; where it is not, ``a`` must be the same (inf
    with its sign, or NaN)."""
    fin_b = torch.isfinite(b)
    if not torch.isfinite(a[fin_b]).all():
        return True
    a_n, b_n = a[~fin_b], b[~fin_b]
    return not (torch.equal(torch.isnan(a_n), torch.isnan(b_n))
                and torch.equal(a_n[~torch.isnan(a_n)], b_n[~torch.isnan(b_n)]))


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| over the reference's finite entries, relative to max |b| there; ``inf`` when the
    shapes differ or ``a`` has a NaN or inf the reference does not (with its sign): never NaN, so no fold
    of errors can lose a bad one."""
    a, b = a.double().to(b.device), b.double()
    if a.shape != b.shape or _nonfinite_mismatch(a, b):
        return float("inf")
    finite = torch.isfinite(b)
    if not finite.any():
        return 0.0
    scale = b[finite].abs().max().item()
    return (a - b)[finite].abs().max().item() / max(scale, 1e-30)


def _abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| over the reference's finite entries (for lse: nats), non-finite rules of :func:`_rel_err`."""
    a, b = a.double().to(b.device), b.double()
    if a.shape != b.shape or _nonfinite_mismatch(a, b):
        return float("inf")
    finite = torch.isfinite(b)
    return (a - b)[finite].abs().max().item() if finite.any() else 0.0


def copy_overlap(extra_s: float, copy_s: float) -> dict:
    """How much of ``copy_s`` (the copies' time if run serially) the step hid, from ``extra_s`` (its time over
    the run without copies): ``hidden_share`` in [0, 1] (``None`` when nothing was copied) and
    ``unexplained_s``, the extra time the copies cannot account for even if none was hidden."""
    if copy_s <= 0:
        return {"hidden_share": None, "unexplained_s": max(extra_s, 0.0)}
    return {"hidden_share": min(max(1 - extra_s / copy_s, 0.0), 1.0), "unexplained_s": max(extra_s - copy_s, 0.0)}


def copy_summary(r: dict) -> str:
    """``copy hidden 37%``, with the extra time that is not the copies' when there is some."""
    text = f"copy hidden {r['hidden_share']:.0%}"
    return text + (f" (+{r['unexplained_s']:.2f} s not copies)" if r.get("unexplained_s", 0) >= 0.005 else "")


def worst(errs) -> float:
    """The largest error, NaN counted as ``inf`` (Python's ``max`` would drop a NaN that is not first)."""
    values = [float("inf") if e != e else e for e in errs]
    return max(values, default=0.0)
