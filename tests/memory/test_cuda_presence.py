"""GPUs present but unusable by torch: a loud error (or a warning when allowed), never a silent CPU run.

The hardware is simulated for real where the check looks: a device directory with ``nvidia0``, an
``nvidia-smi`` executable on PATH, ``CUDA_VISIBLE_DEVICES``.
"""

import os
import stat

import pytest
import torch

from megatron_longctx.kernels import cuda_presence as cp

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA works here: nothing to report")


def _fake_machine(tmp_path):
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").touch()
    (dev / "nvidiactl").touch()
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return str(dev), str(smi)


def test_no_gpu_in_sight_is_fine(tmp_path):
    (tmp_path / "dev").mkdir()
    assert cp.gpu_evidence(dev_dir=str(tmp_path / "dev"), env={}, smi=None) == []
    assert cp.unusable_gpu_reason(dev_dir=str(tmp_path / "dev"), env={"CUDA_VISIBLE_DEVICES": ""}, smi=None) is None
    cp.require_usable_cuda(dev_dir=str(tmp_path / "dev"), env={}, smi=None)


def test_present_but_unusable_gpu_fails_loudly(tmp_path, monkeypatch):
    dev, smi = _fake_machine(tmp_path)
    where = dict(dev_dir=dev, env={"CUDA_VISIBLE_DEVICES": "0"}, smi=smi)
    evidence = cp.gpu_evidence(**where)
    assert len(evidence) == 3 and "nvidia0" in evidence[0] and "H200" in evidence[1]
    monkeypatch.delenv(cp.ALLOW_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"torch.cuda.is_available\(\) is False.*LONGCTX_ALLOW_CPU=1"):
        cp.require_usable_cuda(**where)
    monkeypatch.setenv(cp.ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match="silently run on the CPU"):
        cp.require_usable_cuda(**where)
    assert "nvidiactl" not in " ".join(evidence)  # only numbered device nodes count
    assert os.path.exists(smi)
