"""Start one phase of the main job under ``torchrun`` and make sure it ends: no rank outlives ``run``.

``torchrun`` and its ranks run in a process group of their own.  :func:`run_phase` waits for it and
ends the whole group (``SIGTERM``, a short grace, then ``SIGKILL``) when

* ``run`` itself gets ``SIGTERM`` / ``SIGINT`` (re-raised as :class:`Interrupted` once the group is gone);
* a rank reports a failure (it leaves a marker file in the phase's temporary folder before exiting, e.g.
  a collective that passed ``--distributed-timeout-minutes`` because another rank is stuck): the
  remaining ranks are ended after :data:`FAILURE_GRACE_S` instead of torchrun's own 30 s grace, which a
  stopped rank never answers.

The phase's temporary folder (also ``TMPDIR`` of torchrun and the ranks) is removed on every way out.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

FAILURE_GRACE_S = 3.0
TERM_GRACE_S = 5.0
WORKER_MODULE = "megatron_longctx.megatron.main_worker"


class Interrupted(RuntimeError):
    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group (SIGCONT first, so stopped ranks see it), then SIGKILL what is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _group_alive(proc.pid):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    while _group_alive(proc.pid):  # ranks are reaped by torchrun or init; wait until they are gone
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Zombies still count for killpg; look for a live member.
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = open(stat).read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def run_phase(worker_argv: list[str], nproc: int, settings: dict[str, Any],
              env: Optional[dict[str, str]] = None) -> tuple[int, list[str]]:
    """Run one torchrun phase; returns ``(exit code, failure reports of the ranks)``."""
    tmp = tempfile.mkdtemp(prefix="longctx-run-")
    settings = dict(settings, marker_dir=tmp)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", "-m", WORKER_MODULE, *worker_argv]
    child_env = dict(os.environ, **(env or {}))
    child_env["LONGCTX_JOB"] = json.dumps(settings)
    child_env["TMPDIR"] = tmp  # torchrun's and the ranks' temporary files go where they are removed
    child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    child_env.setdefault("PYTHONWARNINGS", "ignore")
    child_env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron asserts it for CP > 1 on GPUs
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    proc = subprocess.Popen(cmd, env=child_env, start_new_session=True)
    try:
        failed_at: Optional[float] = None
        while True:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            if received:
                _end_group(proc, TERM_GRACE_S)
                raise Interrupted(received[0])
            if failed_at is None and glob.glob(os.path.join(tmp, "*.failed")):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
                _end_group(proc, 0.5)
                rc = proc.returncode or 1
                break
        if _group_alive(proc.pid):
            _end_group(proc, TERM_GRACE_S)
        reports = [open(p).read() for p in sorted(glob.glob(os.path.join(tmp, "*.failed")))]
        rc = 128 - rc if rc < 0 else rc  # killed by signal N: 128 + N, as a shell reports it
        return (1 if reports and rc == 0 else rc), reports
    finally:
        if proc.poll() is None:
            _end_group(proc, 0.5)
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(tmp, ignore_errors=True)
