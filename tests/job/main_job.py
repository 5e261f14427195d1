"""Helpers for the main-job tests: a tiny ``megatron-longctx run`` as a subprocess, and its processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from megatron_longctx.procs import alive, descendants  # noqa: F401 - the fault tests use both

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# 1 layer, hidden 32, 4 heads in 2 groups, 256 tokens at CP=2: seconds per phase.
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--ffn-hidden-size", "64", "--seq-length", "256", "--max-position-embeddings", "256",
        "--data-max-bytes", str(1 << 20), "--no-progress"]


def skip_without_megatron_training() -> None:
    from megatron_longctx.job.pretrain import megatron_training_available

    reason = megatron_training_available()
    if reason is not None:
        pytest.skip(reason)


def run_argv(out: str, data: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "megatron_longctx.cli", "run", *TINY, "--output-dir", out, "--data-dir", data, *extra]


def env(tmp: str | None = None) -> dict[str, str]:
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if tmp is not None:
        os.makedirs(tmp, exist_ok=True)
        e["TMPDIR"] = tmp
    return e


def run(out: str, data: str, *extra: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(run_argv(out, data, *extra), env=env(), capture_output=True, text=True, timeout=timeout)


def finished(factory, name: str, *extra: str) -> tuple[str, str, subprocess.CompletedProcess]:
    """``(out, data, proc)`` of a run that must succeed, in a new folder of pytest's ``tmp_path_factory``."""
    skip_without_megatron_training()
    root = factory.mktemp(name)
    out, data = str(root / "run"), str(root / "data")
    proc = run(out, data, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, data, proc


def start(out: str, data: str, *extra: str, tmp: str | None = None) -> subprocess.Popen:
    """The run in the background, its output in ``OUT.log`` (a pipe nobody reads would fill and block it)."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    log = open(os.path.abspath(out) + ".log", "w")
    proc = subprocess.Popen(run_argv(out, data, *extra), env=env(tmp), stdout=log, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    proc.log_path = log.name
    log.close()
    return proc


def output(proc: subprocess.Popen) -> str:
    return open(proc.log_path).read()


def metrics(out: str, name: str | None = None) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        if line.strip():
            rows.append(json.loads(line))
    return [r for r in rows if name is None or r["run"] == name]


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, poll: float = 0.01):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}:\n{output(proc)[-4000:]}")
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def rank_pid(run_pid: int, rank: int) -> int:
    """The pid of rank ``rank`` (a main_worker process with ``RANK=rank``) under the run ``run_pid``."""
    for pid in descendants(run_pid):
        try:
            cmdline = open(f"/proc/{pid}/cmdline").read()
            environ = open(f"/proc/{pid}/environ").read().split("\0")
        except OSError:
            continue
        if "megatron_longctx.job.worker" in cmdline and "torch.distributed.run" not in cmdline \
                and f"RANK={rank}" in environ:
            return pid
    raise AssertionError(f"no rank {rank} under process {run_pid}")
