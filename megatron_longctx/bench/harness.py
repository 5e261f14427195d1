"""What every benchmark shares: the environment record written beside its figures and the JSON writer."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Optional

import torch


def environment(**settings: Any) -> dict[str, Any]:
    """The ``meta`` record of a run: versions, threads and machine, then the benchmark's own ``settings``."""
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(), **settings}


def median_seconds(fn: Callable[[], Any], repeats: int, *, warm_up: bool = True,
                   device: Optional[torch.device] = None) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn`` after one untimed call (``warm_up``); on a CUDA
    ``device`` each call is bracketed by synchronisations."""
    sync = device is not None and device.type == "cuda"
    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` (its folder made if missing) and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


__all__ = ["environment", "median_seconds", "write_json"]
