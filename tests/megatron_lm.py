"""Megatron-LM's unmodified training scripts as test fixtures: find them, copy them, run them.

The scripts (``pretrain_gpt.py`` and the two neighbours it imports) are not part of this project: they
are looked up in ``$MEGATRON_LM_DIR`` first (a folder holding ``<ref>/pretrain_gpt.py``, or
``pretrain_gpt.py`` itself for the default ref), then in ``../shared/megatron-lm/<ref>`` beside the
project root.  :func:`require_scripts` skips the test with that reason when neither exists, and
:func:`require_training` when the installed megatron-core has no ``megatron.training`` (the 0.16.1
wheel has none).  :func:`copy_scripts` copies them into a test's temporary folder (which has no
``megatron/`` folder, so the installed megatron-core is what gets imported), and :func:`run_script`
runs one through ``torchrun`` and :mod:`megatron_longctx.launch`, reading the full-precision losses the
launcher writes to ``$LONGCTX_LOSS_LOG``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import pytest

REPO = Path(__file__).resolve().parent.parent
REF_019 = "core_r0.19.0"
REF_016 = "core_v0.16.1"
SCRIPT_FILES = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")
TIMEOUT_S = int(os.environ.get("LONGCTX_TEST_TIMEOUT", "600"))

# The smallest GPT that exercises every layer type: 2 layers, hidden 64, 4 heads, 256 tokens.
# No dropout (each CP rank would draw its own masks), no evaluation (it only costs time).
TINY_GPT = (
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
    "--seed", "1234",
)


def scripts_dir(ref: str = REF_019) -> Optional[Path]:
    """The folder holding Megatron-LM's ``pretrain_gpt.py`` of ``ref``, or ``None``."""
    candidates = []
    env = os.environ.get("MEGATRON_LM_DIR")
    if env:
        candidates.append(Path(env) / ref)
        if ref == REF_019:
            candidates.append(Path(env))
    candidates.append(REPO.parent / "shared" / "megatron-lm" / ref)
    for folder in candidates:
        if all((folder / name).is_file() for name in SCRIPT_FILES):
            return folder
    return None


def require_scripts(ref: str = REF_019) -> Path:
    folder = scripts_dir(ref)
    if folder is None:
        pytest.skip(f"Megatron-LM's {ref} scripts not found: set MEGATRON_LM_DIR or provide "
                    f"{REPO.parent / 'shared' / 'megatron-lm' / ref}/pretrain_gpt.py")
    return folder


def has_training() -> bool:
    try:
        import megatron.training.arguments  # noqa: F401
    except ImportError:
        return False
    return True


def require_training() -> None:
    if not has_training():
        pytest.skip("this megatron-core has no megatron.training (the 0.16.1 wheel ships none), which "
                    "Megatron-LM's scripts need")


def copy_scripts(dst: Path, ref: str = REF_019) -> Path:
    """Copy the scripts of ``ref`` into ``dst`` (created); return ``dst / 'pretrain_gpt.py'``."""
    src = require_scripts(ref)
    dst.mkdir(parents=True, exist_ok=True)
    for name in SCRIPT_FILES:
        shutil.copy(src / name, dst / name)
    return dst / "pretrain_gpt.py"


@dataclasses.dataclass
class ScriptRun:
    """One run of a script: exit status, output, the launcher's full-precision losses, wall time, and the
    largest peak resident set size of the job's processes (torchrun and every rank)."""

    returncode: int
    output: str
    losses: list[dict]
    wall_s: float
    peak_rss_bytes: int = 0

    def lm_losses(self) -> list[float]:
        return [row["lm loss"] for row in self.losses]

    def check(self) -> "ScriptRun":
        assert self.returncode == 0, self.output[-4000:]
        return self


LAUNCHER = ("-m", "megatron_longctx.launch")


def run_script(script: Path, args: Sequence[str], nproc: int = 2, launcher: Sequence[str] = LAUNCHER,
               env: Optional[dict] = None, timeout: int = TIMEOUT_S) -> ScriptRun:
    """``torchrun --nproc-per-node nproc <launcher> script args`` from the script's folder (``nproc=0``: no
    torchrun, one plain process; ``launcher=()``: the script itself)."""
    loss_log = script.parent / f"losses-{time.monotonic_ns()}.jsonl"
    run_env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   LONGCTX_LOSS_LOG=str(loss_log), **(env or {}))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command = ([sys.executable] if nproc == 0 else torchrun) + list(launcher) + [str(script), *args]
    start = time.monotonic()
    returncode, output, peak = _run_reaped(command, script.parent, run_env, timeout)
    wall = time.monotonic() - start
    losses = [json.loads(line) for line in loss_log.read_text().splitlines()] if loss_log.exists() else []
    return ScriptRun(returncode, output, losses, wall, peak)


def _run_reaped(command: list[str], cwd: Path, env: dict, timeout: int) -> tuple[int, str, int]:
    """Run ``command`` to its end: (exit code, stdout + stderr, peak RSS in bytes of it and its descendants).

    ``wait4`` reports the child's ``ru_maxrss`` folded with those of the descendants it reaped (torchrun
    reaps its ranks).  Past ``timeout`` the whole process group is killed and ``TimeoutExpired`` raised.
    """
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        os.killpg(proc.pid, signal.SIGKILL)

    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        output = out.read().decode(errors="replace")
    if expired.is_set():
        raise subprocess.TimeoutExpired(command, timeout, output)
    return proc.returncode, output, usage.ru_maxrss * 1024  # Linux reports KiB


def assert_same_losses(actual: Sequence[float], expected: Sequence[float], rtol: float = 1e-5) -> None:
    """Same number of iterations and each loss within ``rtol`` (relative)."""
    import torch

    assert len(actual) == len(expected) and len(expected) > 0, (actual, expected)
    torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=rtol, atol=0.0)
