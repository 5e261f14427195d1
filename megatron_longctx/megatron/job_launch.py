"""Start one phase of the main job under ``torchrun`` and make sure it ends: no rank outlives ``run``.

``torchrun`` runs in a session of its own and starts each rank in another; :func:`run_phase` keeps
track of them by pid, waits, and ends torchrun and every rank (``SIGCONT`` and ``SIGTERM``, a short
grace, then ``SIGKILL``) when

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


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(pid: int) -> set[int]:
    """Live descendants of ``pid`` (torchrun starts each rank in a session of its own, so a process-group
    signal to torchrun does not reach them: they are tracked by pid)."""
    children, out, todo = _children_map(), set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    with contextlib.suppress(OSError, IndexError):
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def _signal_all(pids: set[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signum) if os.getpgid(pid) == pid else os.kill(pid, signum)


def _end_group(proc: subprocess.Popen, grace_s: float, known: set[int]) -> None:
    """SIGTERM torchrun and every rank (SIGCONT first, so stopped ranks see it), then SIGKILL what is left."""
    pids = {proc.pid} | known | descendants(proc.pid)
    for signum in (signal.SIGCONT, signal.SIGTERM):
        _signal_all(pids, signum)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
    pids |= {d for p in pids if _alive(p) for d in descendants(p)}
    _signal_all({p for p in pids if _alive(p)}, signal.SIGKILL)
    proc.wait()
    while any(_alive(p) for p in pids):  # reaped by torchrun or init; wait until they are gone
        time.sleep(0.05)


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
    known: set[int] = set()
    try:
        failed_at: Optional[float] = None
        polls = 0
        while True:
            try:
                rc = proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            polls += 1
            if polls % 5 == 1:  # once a second: remember the ranks, in case torchrun goes first
                known |= descendants(proc.pid)
            if received:
                _end_group(proc, TERM_GRACE_S, known)
                raise Interrupted(received[0])
            if failed_at is None and glob.glob(os.path.join(tmp, "*.failed")):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
                _end_group(proc, 0.5, known)
                rc = proc.returncode or 1
                break
        if any(_alive(p) for p in known):
            _end_group(proc, TERM_GRACE_S, known)
        reports = [open(p).read() for p in sorted(glob.glob(os.path.join(tmp, "*.failed")))]
        rc = 128 - rc if rc < 0 else rc  # killed by signal N: 128 + N, as a shell reports it
        return (1 if reports and rc == 0 else rc), reports
    finally:
        if proc.poll() is None or any(_alive(p) for p in known):
            _end_group(proc, 0.5, known)
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(tmp, ignore_errors=True)
