"""Start one phase of the main job under ``torchrun`` and make sure it ends: no rank outlives ``run``.

:func:`run_phase` launches the phase through :func:`megatron_longctx.procs.torchrun`, which keeps track
of torchrun's ranks by pid (each runs in a session of its own) and ends torchrun and every rank
(``SIGCONT`` and ``SIGTERM``, a short grace, then ``SIGKILL``) on every way out.  The phase is ended early
when

* ``run`` itself gets ``SIGTERM`` / ``SIGINT`` (re-raised as :class:`Interrupted` once the group is gone);
* a rank reports a failure (it leaves a marker file in the phase's temporary folder before exiting, e.g.
  a collective that passed ``--distributed-timeout-minutes`` because another rank is stuck): the
  remaining ranks are ended after :data:`FAILURE_GRACE_S` instead of torchrun's own 30 s grace, which a
  stopped rank never answers.

The phase's temporary folder (also ``TMPDIR`` of torchrun and the ranks) is removed on every way out.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import tempfile
import time
from typing import Any

from megatron_longctx.procs import torchrun

FAILURE_GRACE_S = 3.0
TERM_GRACE_S = 5.0
KILL_GRACE_S = 0.5  # SIGTERM to SIGKILL once a rank reported a failure
WORKER_MODULE = "megatron_longctx.job.worker"


class Interrupted(RuntimeError):
    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def run_phase(worker_argv: list[str], nproc: int, settings: dict[str, Any],
              env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """Run one torchrun phase; returns ``(exit code, failure reports of the ranks)``.

    The phase's output goes to this process's stdout and stderr as it is written.
    """
    tmp = tempfile.mkdtemp(prefix="longctx-run-")
    child_env = dict(env or {}, LONGCTX_JOB=json.dumps(dict(settings, marker_dir=tmp)),
                     TMPDIR=tmp)  # torchrun's and the ranks' temporary files go where they are removed
    defaults = {"PYTHONWARNINGS": "ignore",
                "CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # Megatron asserts it for CP > 1 on GPUs
    received: list[int] = []
    interrupted: list[int] = []
    failed_at: list[float] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)

    def watch() -> float | None:
        if received:
            interrupted.append(received[0])
            return TERM_GRACE_S
        if not failed_at and glob.glob(os.path.join(tmp, "*.failed")):
            failed_at.append(time.monotonic())
        if failed_at and time.monotonic() - failed_at[0] > FAILURE_GRACE_S:
            return KILL_GRACE_S
        return None

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rc, _ = torchrun(WORKER_MODULE, worker_argv, nproc, env=child_env, defaults=defaults, capture=False,
                         watch=watch)
        if interrupted:
            raise Interrupted(interrupted[0])
        reports = []
        for path in sorted(glob.glob(os.path.join(tmp, "*.failed"))):
            with open(path) as f:
                reports.append(f.read())
        return (1 if reports and rc == 0 else rc), reports
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(tmp, ignore_errors=True)
