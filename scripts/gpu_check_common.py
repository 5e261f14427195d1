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
)
_TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
             ffn_hidden_size=128, vocab_size=256)
CPU_SIZES = Sizes(
    kernel_timing_seq=128, ring_tokens=256, ring_sizes=(2, 4, 8), heads=(4, 2, 16),
    offload_model=_TINY, offload_seq=64, gpt_model=_TINY, gpt_seq=64,
    stack=_TINY, seq_start=64, seq_cap=256, seq_granularity=32, numerics_seq=64,
    tiled_numerics_seq=64, tiled_model=_TINY, tiled_memory_seq=64,
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
