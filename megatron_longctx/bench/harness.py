"""What every benchmark shares: the environment record written beside its figures and the JSON writer."""

from __future__ import annotations

import json
import os
import platform
from typing import Any

import torch


def environment(**settings: Any) -> dict[str, Any]:
    """The ``meta`` record of a run: versions, threads and machine, then the benchmark's own ``settings``."""
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(), **settings}


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` (its folder made if missing) and say so."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


__all__ = ["environment", "write_json"]
