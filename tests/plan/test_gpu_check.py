"""scripts/gpu_check.py: the dry run (--allow-cpu) goes through every section's code path on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.py")


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the script would really run")
def test_reports_no_cuda_cleanly(tmp_path):
    out = tmp_path / "check.json"
    proc = _run("--out", str(out), timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "no CUDA device" in proc.stdout and "Traceback" not in proc.stderr
    assert json.loads(out.read_text())["status"] == "no_cuda"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU path")
def test_dry_run_on_cpu_runs_every_section(tmp_path):
    out = tmp_path / "check.json"
    proc = _run("--allow-cpu", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    sections = report["sections"]
    assert list(sections) == ["environment", "kernels", "ring_overhead", "offload", "max_seq"]
    assert report["dry_run"] is True
    # CUDA kernels say why they are skipped; the CPU kernel is compared with the reference.
    assert sections["kernels"]["sdpa_cuda"]["status"] == "skipped" and sections["kernels"]["sdpa_cuda"]["reason"]
    cpu_cases = sections["kernels"]["cpu_flash"]["cases"]
    assert cpu_cases and all(c["status"] == "ok" for c in cpu_cases)
    # The emulated ring schedule reproduces one call over the same tokens.
    rows = sections["ring_overhead"]["rows"]
    assert [r["cp"] for r in rows] == [2, 4]
    assert all(r["max_rel_err_vs_single_call"] < 1e-4 and r["blocks"] > 0 for r in rows)
    assert sections["offload"]["grad_max_rel_err"] <= 1e-6
    max_seq = sections["max_seq"]
    if max_seq["status"] == "skipped":
        assert "megatron-core" in max_seq["reason"]
    else:
        assert max_seq["status"] == "ok" and max_seq["max_trained_seq"] >= 64
    for name in sections:
        assert name in proc.stdout  # the table
