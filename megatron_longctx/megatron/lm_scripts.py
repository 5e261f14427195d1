"""Megatron-LM's unmodified training scripts: find them, copy them, run them under the launcher.

The scripts (``pretrain_gpt.py`` and the two neighbours it imports) are not part of this project: they
are looked up in ``$MEGATRON_LM_DIR`` first (a folder holding ``<ref>/pretrain_gpt.py``, or
``pretrain_gpt.py`` itself for the default ref), then in ``../shared/megatron-lm/<ref>`` beside the
project root.  :func:`copy_scripts` copies them into a folder of their own (one without a ``megatron/``
folder, so the installed megatron-core is what gets imported), and :func:`run_script` runs one through
``torchrun`` and :mod:`megatron_longctx.launch`, reading the full-precision losses the launcher writes to
``$LONGCTX_LOSS_LOG``, Megatron's per-iteration times and the peak memory of the job's processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from megatron_longctx import procs
from megatron_longctx.megatron.script_setup import LOSS_LOG_ENV

PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent
REF_019 = "core_r0.19.0"
REF_016 = "core_v0.16.1"
SCRIPT_FILES = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")
SCRIPTS_ENV = "MEGATRON_LM_DIR"
LAUNCHER = ("-m", "megatron_longctx.launch")
BASELINE_LAUNCHER = ("-m", "megatron_longctx.megatron.cpu_compat")  # the same script without the plugin
# Megatron's training log line: " iteration        2/       2 | ... | elapsed time per iteration (ms): 1234.5 |"
_ITERATION_TIME = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def default_scripts_folder(ref: str = REF_019) -> Path:
    """Where the scripts of ``ref`` are looked for when ``$MEGATRON_LM_DIR`` does not have them."""
    return PROJECT_ROOT.parent / "shared" / "megatron-lm" / ref


def scripts_dir(ref: str = REF_019) -> Optional[Path]:
    """The folder holding Megatron-LM's ``pretrain_gpt.py`` of ``ref``, or ``None``."""
    candidates = []
    env = os.environ.get(SCRIPTS_ENV)
    if env:
        candidates.append(Path(env) / ref)
        if ref == REF_019:
            candidates.append(Path(env))
    candidates.append(default_scripts_folder(ref))
    for folder in candidates:
        if all((folder / name).is_file() for name in SCRIPT_FILES):
            return folder
    return None


def missing_scripts_message(ref: str = REF_019) -> str:
    return (f"Megatron-LM's {ref} scripts not found: set {SCRIPTS_ENV} or provide "
            f"{default_scripts_folder(ref)}/pretrain_gpt.py")


def copy_scripts(dst: Path, ref: str = REF_019) -> Path:
    """Copy the scripts of ``ref`` into ``dst`` (created); return ``dst / 'pretrain_gpt.py'``.
    ``FileNotFoundError`` when they are nowhere to be found."""
    src = scripts_dir(ref)
    if src is None:
        raise FileNotFoundError(missing_scripts_message(ref))
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in SCRIPT_FILES:
        shutil.copy(src / name, dst / name)
    return dst / "pretrain_gpt.py"


@dataclasses.dataclass
class ScriptRun:
    """One run of a script: exit status, output, the launcher's full-precision losses, wall time, the largest
    peak resident set size of the job's processes (torchrun and every rank) and each one's sampled peak."""

    returncode: int
    output: str
    losses: list[dict]
    wall_s: float
    peak_rss_bytes: int = 0
    process_peaks: dict[int, int] = dataclasses.field(default_factory=dict)
    rank_pids: list[int] = dataclasses.field(default_factory=list)  # torchrun's children (the ranks)
    timed_out: bool = False
    over_memory: bool = False

    def lm_losses(self) -> list[float]:
        return [row["lm loss"] for row in self.losses]

    def grad_norms(self) -> list[float]:
        """Megatron's gradient norm of each logged iteration."""
        return [row["grad norm"] for row in self.losses]

    def iteration_times_s(self) -> dict[int, float]:
        """Megatron's ``elapsed time per iteration`` of each logged iteration, in seconds."""
        return {int(it): float(ms) / 1000.0 for it, ms in _ITERATION_TIME.findall(self.output)}

    def rank_peaks_bytes(self) -> list[int]:
        """Each rank's peak resident memory as last sampled (``peak_rss_bytes`` is the exact largest)."""
        return [self.process_peaks.get(pid, 0) for pid in self.rank_pids]

    def check(self) -> "ScriptRun":
        assert self.returncode == 0, self.output[-4000:]
        return self


def run_script(script: Path, args: Sequence[str], nproc: int = 2, launcher: Sequence[str] = LAUNCHER,
               env: Optional[dict] = None, timeout: Optional[float] = None,
               rss_limit_bytes: Optional[int] = None) -> ScriptRun:
    """``torchrun --nproc-per-node nproc <launcher> script args`` from the script's folder (``nproc=0``: no
    torchrun, one plain process; ``launcher=()``: the script itself), with this package first on the
    ranks' ``PYTHONPATH``.  Past ``timeout`` seconds, or when a process's resident memory passes
    ``rss_limit_bytes``, the job is killed (``timed_out`` / ``over_memory``)."""
    script = Path(script)
    loss_log = script.parent / f"losses-{time.monotonic_ns()}.jsonl"
    run_env = dict(os.environ, **{"PYTHONPATH": os.pathsep.join([str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")]),
                                  LOSS_LOG_ENV: str(loss_log)}, **(env or {}))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command = ([sys.executable] if nproc == 0 else torchrun) + list(launcher) + [str(script), *args]
    measured = procs.run_measured(command, script.parent, run_env, timeout, rss_limit_bytes)
    losses = [json.loads(line) for line in loss_log.read_text().splitlines()] if loss_log.exists() else []
    return ScriptRun(measured.returncode, measured.output, losses, measured.wall_s, measured.peak_rss_bytes,
                     measured.process_peaks, measured.child_pids if nproc else [], measured.timed_out,
                     measured.over_memory)


__all__ = ["LAUNCHER", "BASELINE_LAUNCHER", "REF_016", "REF_019", "SCRIPT_FILES", "ScriptRun", "copy_scripts",
           "run_script", "scripts_dir"]
