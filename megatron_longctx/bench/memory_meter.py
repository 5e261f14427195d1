"""The benchmark's memory measure: the peak a block adds on this rank, and the budget a probe enforces (a
rank over it ends its process with :data:`EXIT_OVER_BUDGET`)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

import torch
import torch.distributed as dist


class MemoryMeter:
    """Peak memory a block adds on this rank, over ``base_bytes``: :class:`~megatron_longctx.memory.accounting.PeakMemory`
    (CUDA ``max_memory_allocated`` on GPU, sampled RSS and ``ru_maxrss`` on CPU) plus an enforced budget.

    ``budget_bytes`` (optional): on CPU a watchdog reads PeakMemory's running peak and ends the process
    with :data:`EXIT_OVER_BUDGET` as soon as peak − ``base_bytes`` passes it (on GPU the caller sets
    ``torch.cuda.set_per_process_memory_fraction`` and an OOM is the failure).
    """

    def __init__(self, device: torch.device, base_bytes: int, budget_bytes: Optional[int] = None,
                 interval_s: float = 0.002) -> None:
        from megatron_longctx.memory.accounting import PeakMemory

        self.base_bytes = base_bytes
        self.budget_bytes = budget_bytes
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._peak = PeakMemory(device, interval_s=interval_s)
        self._stop = threading.Event()
        self._watchdog: Optional[threading.Thread] = None

    def _watch(self) -> None:
        while not self._stop.is_set():
            used = self._peak.peak_bytes - self.base_bytes
            if used > self.budget_bytes:
                over_budget_exit(used, self.budget_bytes)
            time.sleep(self.interval_s)

    def __enter__(self) -> "MemoryMeter":
        self.peak_bytes = 0
        self._peak.__enter__()
        if self.budget_bytes is not None and self._peak.device.type == "cpu":
            self._stop.clear()
            self._watchdog = threading.Thread(target=self._watch, daemon=True)
            self._watchdog.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._peak.__exit__(*exc)
        if self._watchdog is not None:
            self._stop.set()
            self._watchdog.join()
            self._watchdog = None
        on_gpu = self._peak.device.type == "cuda"
        self.peak_bytes = self._peak.peak_bytes if on_gpu else self._peak.peak_bytes - self.base_bytes
        if self.budget_bytes is not None and not on_gpu and self.peak_bytes > self.budget_bytes:
            over_budget_exit(self.peak_bytes, self.budget_bytes)  # a spike between samples, seen by ru_maxrss


EXIT_OVER_BUDGET = 75


def over_budget_exit(used: int, budget: int) -> None:
    print(f"[memory budget] rank {dist.get_rank() if dist.is_initialized() else 0}: {used / 2**20:.1f} MiB "
          f"> budget {budget / 2**20:.1f} MiB", flush=True)
    os._exit(EXIT_OVER_BUDGET)
