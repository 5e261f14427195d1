"""On a CUDA machine, the checks of ``scripts/gpu_check.py`` through pytest: every kernel backend against the
float64 reference in bf16/fp16, the ring and the packed ring on real streams, an offloaded step with the side
stream and pinned pool, the tiled replay and the fused weight-gradient accumulation under Megatron's DDP.
Skipped (with the reason) where CUDA is absent; the CPU dry run of the same code is
``tests/plan/test_gpu_check.py``.  The child sees this process's environment as it is: ``CUDA_VISIBLE_DEVICES``
(Slurm, per-GPU torchrun, MIG) picks the GPU it runs on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the CPU dry run is "
                                "tests/plan/test_gpu_check.py")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = ["environment", "kernels", "ring", "windows", "packed", "offload", "tiled_replay", "fused_replay"]


def test_gpu_check_sections_pass_on_this_gpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_check.py"), "--sections", *SMOKE,
                           "--out", str(out)], capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT)
    report = json.loads(out.read_text())
    # only "ok" passes: "failed", "error", "incomplete" (a budget skip) and "unavailable" all fail here
    not_ok = {name: (r["status"], r.get("error") or r.get("reason")) for name, r in report["sections"].items()
              if r["status"] != "ok"}
    assert proc.returncode == 0 and not not_ok, (not_ok, proc.stdout[-4000:])
    assert report["dry_run"] is False and list(report["sections"]) == SMOKE
    if "CUDA_VISIBLE_DEVICES" in os.environ:  # the child ran on the GPU this process was given
        assert report["sections"]["environment"]["name"] == torch.cuda.get_device_name(0)
