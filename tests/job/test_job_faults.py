"""Faults end cleanly: a stuck rank fails the job within the configured timeout, and SIGTERM to ``run``
stops torchrun and every rank and removes the run's temporary files."""

import os
import signal
import time

import pytest

from tests.job import main_job


def test_stalled_rank_fails_the_job_within_the_timeout(tmp_path):
    main_job.skip_without_megatron_training()
    out = str(tmp_path / "run")
    proc = main_job.start(out, str(tmp_path / "data"), "--train-iters", "500", "--no-baseline", "--no-resume-check",
                          "--distributed-timeout-seconds-after-init", "5", tmp=str(tmp_path / "tmp"))
    main_job.wait_for(lambda: len(main_job.metrics(out)) >= 2, 300, "two steps", proc)
    rank1 = main_job.rank_pid(proc.pid, 1)
    family = main_job.descendants(proc.pid)
    os.kill(rank1, signal.SIGSTOP)  # stuck: alive, holding its sockets, never answering
    stalled = time.monotonic()
    try:
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    elapsed = time.monotonic() - stalled
    output = main_job.output(proc)
    assert rc != 0 and elapsed < 60, (rc, elapsed, output[-3000:])
    assert "rank(s) failed, every rank stopped" in output and ("Timed out" in output or "timeout" in output.lower()), output[-3000:]
    assert not [p for p in family if main_job.alive(p)]
    assert _leftovers(tmp_path / "tmp") == []


def _leftovers(tmp):
    """The run's temporary files left in its TMPDIR (torch's inductor cache directory is a cache, not one)."""
    return [name for name in os.listdir(tmp) if not name.startswith("torchinductor_")]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_run_stops_every_process_and_cleans_up(tmp_path, signum):
    main_job.skip_without_megatron_training()
    out = str(tmp_path / "run")
    proc = main_job.start(out, str(tmp_path / "data"), "--train-iters", "500", "--no-baseline", "--no-resume-check",
                          tmp=str(tmp_path / "tmp"))
    main_job.wait_for(lambda: len(main_job.metrics(out)) >= 1, 300, "the first step", proc)
    family = main_job.descendants(proc.pid)
    assert len(family) >= 3  # torchrun and two ranks
    assert _leftovers(tmp_path / "tmp")  # the phase's temporary folder exists while it runs
    sent = time.monotonic()
    os.kill(proc.pid, signum)
    rc = proc.wait(timeout=60)
    assert rc == 128 + signum and time.monotonic() - sent < 30, (rc, main_job.output(proc)[-2000:])
    assert not [p for p in family if main_job.alive(p)]
    assert _leftovers(tmp_path / "tmp") == []
