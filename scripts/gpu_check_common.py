"""Shared pieces of scripts/gpu_check.py: problem sizes, time budgets, timing and error helpers."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch


class Skip(Exception):
    """A section (or case) cannot run here; the message says why."""


@dataclasses.dataclass
class Budget:
    seconds: float
    start: float = dataclasses.field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Problem sizes: real ones on a GPU, tiny ones for the CPU dry run."""

    kernel_cases: tuple  # (b, s, hq, hkv, d, window_left)
    kernel_timing_seq: int
    ring_tokens: int
    ring_sizes: tuple
    heads: tuple  # (hq, hkv, d) for ring/offload
    offload_layers: int
    offload_tokens: int
    offload_hidden: int
    stack: dict  # max_seq model shape
    seq_start: int
    seq_cap: int
    seq_granularity: int


GPU_SIZES = Sizes(
    kernel_cases=((1, 4096, 32, 8, 128, -1), (2, 2048, 16, 16, 64, -1), (1, 4096, 32, 8, 128, 1024)),
    kernel_timing_seq=16384, ring_tokens=65536, ring_sizes=(2, 4, 8), heads=(32, 8, 128),
    offload_layers=8, offload_tokens=16384, offload_hidden=4096,
    stack=dict(num_layers=2, hidden_size=4096, num_attention_heads=32, num_query_groups=8, kv_channels=128,
               ffn_hidden_size=14336, vocab_size=128256),
    seq_start=65536, seq_cap=1 << 23, seq_granularity=16384,
)
CPU_SIZES = Sizes(
    kernel_cases=((1, 64, 4, 2, 16, -1), (1, 64, 4, 4, 8, 16)),
    kernel_timing_seq=128, ring_tokens=256, ring_sizes=(2, 4), heads=(4, 2, 16),
    offload_layers=3, offload_tokens=128, offload_hidden=64,
    stack=dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
               ffn_hidden_size=128, vocab_size=256),
    seq_start=64, seq_cap=256, seq_granularity=32,
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


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    finite = torch.isfinite(b)
    scale = b[finite].abs().max().item() if finite.any() else 1.0
    return ((a - b)[finite].abs().max().item() / max(scale, 1e-30)) if finite.any() else 0.0
