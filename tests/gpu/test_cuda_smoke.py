"""On a CUDA machine, the checks of ``scripts/gpu_check.py`` through pytest: every kernel backend against the
float64 reference in bf16/fp16, the ring on real streams, an offloaded step with the side stream and pinned
pool, the tiled replay and the fused weight-gradient accumulation under Megatron's DDP.  Skipped (with the
reason) where CUDA is absent; the CPU dry run of the same code is ``tests/plan/test_gpu_check.py``."""

from __future__ import annotations

import json

import pytest
import torch

from tests.plan.test_gpu_check import _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CPU dry run is "
                                "tests/plan/test_gpu_check.py")

SMOKE = ["environment", "kernels", "ring", "windows", "offload", "tiled_replay", "fused_replay"]


def test_gpu_check_sections_pass_on_this_gpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = _run("--sections", *SMOKE, "--out", str(out), timeout=1200)
    report = json.loads(out.read_text())
    failed = {name: r.get("error") or r.get("reason") for name, r in report["sections"].items()
              if r["status"] in ("error", "failed")}
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-4000:])
    assert report["dry_run"] is False and list(report["sections"]) == SMOKE
