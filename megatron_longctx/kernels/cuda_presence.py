"""A machine with NVIDIA GPUs whose torch cannot use them must say so, not silently train on the CPU.

``torch.cuda.is_available()`` is False on a machine with GPUs when the driver is older than the CUDA
runtime torch was built for, when torch is a CPU-only build, or when the device nodes are not mapped
into a container.  :func:`unusable_gpu_reason` looks for the hardware (``/dev/nvidia<N>``,
``nvidia-smi -L``, ``CUDA_VISIBLE_DEVICES`` / ``NVIDIA_VISIBLE_DEVICES`` naming devices) and returns
an explanation when it is there but CUDA is not; :func:`require_usable_cuda` raises it unless
``LONGCTX_ALLOW_CPU=1``, and then warns.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import warnings
from typing import Mapping, Optional

import torch

ALLOW_ENV = "LONGCTX_ALLOW_CPU"
_NO_DEVICES = {"", "-1", "none", "void", "nodevfiles"}


def gpu_evidence(dev_dir: str = "/dev", env: Optional[Mapping[str, str]] = None,
                 smi: Optional[str] = "nvidia-smi") -> list[str]:
    """What says this machine has NVIDIA GPUs (empty: nothing does)."""
    env = os.environ if env is None else env
    found = []
    try:
        nodes = sorted(n for n in os.listdir(dev_dir) if re.fullmatch(r"nvidia\d+", n))
    except OSError:
        nodes = []
    if nodes:
        found.append(f"device nodes {', '.join(os.path.join(dev_dir, n) for n in nodes)}")
    exe = shutil.which(smi) if smi else None
    if exe:
        try:
            out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=15).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        gpus = [line.strip() for line in out.splitlines() if line.strip().startswith("GPU ")]
        if gpus:
            found.append(f"nvidia-smi lists {len(gpus)} GPU(s): {gpus[0]}")
    for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = env.get(name)
        if value is not None and value.strip().lower() not in _NO_DEVICES:
            found.append(f"{name}={value}")
    return found


def _init_error() -> str:
    try:
        torch.cuda.init()
    except Exception as exc:  # noqa: BLE001 - the reason CUDA is unusable is what we report
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    return "no error from torch.cuda.init()"


def unusable_gpu_reason(**where) -> Optional[str]:
    """None when CUDA works or no GPU is in sight; else why the GPUs here cannot be used."""
    if torch.cuda.is_available():
        return None
    evidence = gpu_evidence(**where)
    if not evidence:
        return None
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (f"this machine has NVIDIA GPUs ({'; '.join(evidence)}) but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, {build}; {_init_error()}). Training here would silently run on the CPU. "
            "Fix the driver / container GPU mapping or install a torch built for this driver "
            f"(nvidia-smi shows the driver's CUDA version); set {ALLOW_ENV}=1 to run on the CPU anyway.")


def require_usable_cuda(**where) -> None:
    """Raise when GPUs are present but unusable (warn instead when ``LONGCTX_ALLOW_CPU=1``)."""
    reason = unusable_gpu_reason(**where)
    if reason is None:
        return
    if os.environ.get(ALLOW_ENV) == "1":
        warnings.warn(reason, RuntimeWarning, stacklevel=2)
        return
    raise RuntimeError(reason)
