"""The gpu_check dry run's verdicts flip for every planted fault, section by section.

Each fault of :mod:`tests.gpu.faults` is planted for real into the code the attention sections run on the
CPU (``scripts/gpu_check.py --allow-cpu``: kernels on a reduced case set, ring, windows, packed, at
reduced ring sizes), and the test asserts exactly which sections stop being "ok" and with which status.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

from tests.gpu import faults

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")
SECTIONS = ["kernels", "ring", "windows", "packed"]
CASES = ["causal_diagonal", "window_both_tall", "gqa", "mla_dqk_gt_dv", "single_query"]

# fault -> {section: status} for every section that must not be "ok"; every other section stays "ok"
EXPECTED = {
    None: {},
    "nan_grad_cpu_flash": {"kernels": "failed", "ring": "failed", "windows": "failed", "packed": "failed"},
    "nan_grad_varlen": {"packed": "failed"},
    "inf_lse": {"kernels": "failed", "ring": "failed", "windows": "failed", "packed": "failed"},
    "dropped_ring_step": {"ring": "failed", "packed": "failed"},  # ring: the schedule's flops disagree
    "skipped_case": {"kernels": "incomplete"},
}


def run_dry(tmp_path) -> dict:
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    import gpu_check
    from gpu_check_common import CPU_SIZES

    sizes = dataclasses.replace(CPU_SIZES, ring_sizes=(2, 4), packed_cp=(2,))
    report = gpu_check.run(SECTIONS, torch.device("cpu"), sizes, str(tmp_path / "check.json"), 10.0,
                           {"kernels": {"cases": CASES}})
    return {name: r["status"] for name, r in report["sections"].items()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU path")
@pytest.mark.parametrize("fault", list(EXPECTED), ids=lambda f: f or "none")
def test_planted_fault_fails_exactly_its_sections(tmp_path, fault):
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    if fault is None:
        got = run_dry(tmp_path)
    else:
        with faults.FAULTS[fault]():
            got = run_dry(tmp_path)
    want = {name: EXPECTED[fault].get(name, "ok") for name in SECTIONS}
    assert got == want


def test_comparisons_fail_on_nan_and_on_an_inf_of_the_wrong_sign():
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    from gpu_check_common import _abs_err, _rel_err, worst

    want = torch.tensor([0.5, float("-inf"), 2.0])
    assert _abs_err(want.clone(), want) == 0.0 and _rel_err(want.clone(), want) == 0.0
    for bad in ([0.5, float("inf"), 2.0], [0.5, float("-inf"), float("nan")], [float("nan")] * 3, [0.5, 1.0, 2.0]):
        assert _abs_err(torch.tensor(bad), want) == float("inf")
        assert _rel_err(torch.tensor(bad), want) == float("inf")
    assert worst([1e-3, float("nan")]) == float("inf") and worst([float("nan"), 1e-3]) == float("inf")
