"""What every benchmark shares: the environment record written beside its figures, the timing median, the
JSON writer, the text table and the plots' figure handling (torch is imported on use, so the benchmarks
that only start processes stay without it)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Optional


def _version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # noqa: BLE001 - the record is informational
        return "unknown"


def loadavg() -> str:
    """The 1/5/15-minute load average, recorded next to every number (the machine may be shared)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def environment(**settings: Any) -> dict[str, Any]:
    """The ``meta`` record of a run: versions, threads, machine, load and time, then the benchmark's own
    ``settings``."""
    import torch

    return {"torch": torch.__version__, "megatron_core": _version("megatron-core"),
            "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "loadavg": loadavg(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **settings}


def median_seconds(fn: Callable[[], Any], repeats: int, *, warm_up: bool = True, device: Any = None) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn`` after one untimed call (``warm_up``); on a CUDA
    ``device`` each call is bracketed by synchronisations."""
    sync = device is not None and getattr(device, "type", None) == "cuda"
    if sync:
        import torch
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


def write_json(path: str, payload: dict[str, Any], default: Optional[Callable[[Any], Any]] = None) -> None:
    """Write ``payload`` to ``path`` (its folder made if missing) and say so; ``default``: json's, for what it
    cannot write."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, default=default)
    print(f"wrote {path}")


# A table column: its header, the cell's value from a row, the value's format spec ("" for text).
Column = tuple[str, Callable[[dict[str, Any]], Any], str]


def table(columns: list[Column], rows: list[dict[str, Any]]) -> str:
    """``rows`` as an aligned text table under ``columns``' headers: each column as wide as its widest cell,
    text left-aligned and numbers right-aligned."""
    cells = [[format(get(r), spec) for _, get, spec in columns] for r in rows]
    text = [bool(rows) and all(isinstance(get(r), str) for r in rows) for _, get, _ in columns]
    widths = [max([len(header)] + [len(c[i]) for c in cells]) for i, (header, _, _) in enumerate(columns)]

    def line(values: list[str]) -> str:
        return " ".join(v.ljust(w) if left else v.rjust(w) for v, w, left in zip(values, widths, text)).rstrip()

    return "\n".join([line([header for header, _, _ in columns])] + [line(c) for c in cells])


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend; None when matplotlib is not installed
    (``pip install 'megatron-longctx[bench]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig: Any, path: str) -> str:
    """Lay ``fig`` out, write it to ``path`` and free it; ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_log_axes(ax: Any, ylabel: str, legend_size: int) -> None:
    """A matplotlib axis of ``ylabel`` against the sequence length, both on log scales, with a legend."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=legend_size)


__all__ = ["Column", "environment", "loadavg", "log_log_axes", "median_seconds", "pyplot", "save_figure", "table",
           "write_json"]
