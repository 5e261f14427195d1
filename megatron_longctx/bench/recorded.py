"""The headline figures recorded in the repository (``recorded.json`` beside this file) and the gate that
holds a landing to them.

``recorded.json`` keeps, per landing, the max trainable sequence of the searched configurations under the
per-rank budget (every probe in a fresh process: :mod:`.maxseq`), the headline ratio, the command that
measured them, and the gate: one configuration, one length, one budget.  :func:`gate_probe` trains that
one point in a fresh probe job, as the max-sequence search does, and says whether it still fits (a CI
test runs it); ``megatron-longctx bench --compare-recorded`` compares a full run's figures with the
recorded ones (:func:`megatron_longctx.bench.compare.compare_recorded`).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Optional

from megatron_longctx.bench.compare import RECORDED_PATH, load_recorded as load

__all__ = ["RECORDED_PATH", "gate_probe", "load"]


def gate_probe(gate: dict[str, Any], log: Callable[[str], None] = lambda s: None,
               data_dir: Optional[str] = None) -> dict[str, Any]:
    """Train ``gate["config"]`` at ``gate["seq_length"]`` tokens under ``gate["budget_mib"]`` per rank in one
    fresh probe job (its base measured after the job's warm-up); the search record of that one probe:
    ``{"max_seq": seq_length when it fits else 0, "probes": [{"seq_length", "ok", "status", ...}]}``."""
    from megatron_longctx.bench import regression

    seq, nproc = int(gate["seq_length"]), int(gate.get("nproc_per_node", 2))
    args = regression.build_parser().parse_args([
        "--nproc-per-node", str(nproc), "--preset", gate["preset"],
        "--max-seq-start", str(seq), "--max-seq-cap", str(seq), "--timeout", str(gate.get("timeout_s", 600))]
        + ([] if gate.get("distributed_optimizer", False) else ["--no-distributed-optimizer"]))
    data_dir = data_dir or os.path.join(tempfile.gettempdir(), "longctx-gate-data")
    base_task = regression.probe_task(args, regression.model_shape(args), data_dir, warmup=0, steps=1)
    budget = int(float(gate["budget_mib"]) * 2**20)
    out = regression._max_seq(args, base_task, [gate["config"]], budget, log)
    return out["results"][gate["config"]]
