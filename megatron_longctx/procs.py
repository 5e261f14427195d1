"""Local multi-process launches: a free TCP port, ``torchrun`` jobs, and one fresh process per rank.

* :func:`free_port`: a port on 127.0.0.1 that was free a moment ago (the rendezvous of a local job).
* :func:`torchrun`: ``python -m torch.distributed.run ... -m module argv`` on this node; waits, optionally
  captures the combined output, and makes sure no process of the job outlives the call.  ``torchrun``
  starts each rank in a session of its own, so a signal to torchrun's process group does not reach the
  ranks: they are tracked by pid and ended with it (``SIGCONT`` and ``SIGTERM``, a grace, ``SIGKILL``).
* :func:`spawn_ranks`: ``fn(*args)`` on ``world`` freshly spawned processes joined by a gloo group; the
  return values in rank order, or :class:`RankFailed` as soon as one rank raises or dies (the others are
  killed; a dead rank is never waited on until the timeout).
* :func:`run_measured`: a command (a ``torchrun`` job, a script) to its end with the peak resident memory
  of its largest process, each process's sampled peak, and an optional limit on any process's memory.

This module is a leaf: it imports nothing from the rest of the package, and torch only inside a rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

POLL_S = 0.2
TIMEOUT_RC = 124  # exit code of a job that ran past its timeout, as coreutils' ``timeout`` reports it
TIMEOUT_GRACE_S = 2.0  # SIGTERM to SIGKILL when a job ran past its timeout
EXIT_GRACE_S = 5.0  # ... when ranks outlive a torchrun that exited
JOIN_S = 30.0  # how long finished ranks of :func:`spawn_ranks` get to exit before they are killed


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS reported free (bound and released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def process_groups_released() -> Any:
    """Destroy, on leaving, the torch.distributed process groups created inside the block.

    Megatron's ``destroy_model_parallel`` forgets its groups without destroying them, and each gloo group
    keeps its threads alive: a process that sets Megatron's parallel state up again and again (a test
    rank serving many tests, a benchmark probe measuring many points) otherwise piles up thousands of
    threads, and everything it times afterwards is slower."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    before = set(distributed_c10d._world.pg_map)
    try:
        yield
    finally:
        for group in set(distributed_c10d._world.pg_map) - before:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)


# ------------------------------------------------------------------------------------ process trees
def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(pid: int, children: dict[int, list[int]] | None = None) -> set[int]:
    """Live descendants of ``pid``, whatever session they run in (``children``: a map read before)."""
    children, out, todo = _children_map() if children is None else children, set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def _signal_all(pids: set[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signum) if os.getpgid(pid) == pid else os.kill(pid, signum)


def end_tree(proc: subprocess.Popen, grace_s: float, known: set[int]) -> None:
    """SIGTERM ``proc``, its descendants and the ``known`` pids (SIGCONT first, so stopped processes see
    it), SIGKILL whatever is left after ``grace_s``; returns when all of them are gone."""
    pids = {proc.pid} | known | descendants(proc.pid)
    for signum in (signal.SIGCONT, signal.SIGTERM):
        _signal_all(pids, signum)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
    pids |= {d for p in pids if alive(p) for d in descendants(p)}
    _signal_all({p for p in pids if alive(p)}, signal.SIGKILL)
    proc.wait()
    while any(alive(p) for p in pids):  # reaped by their parent or init; wait until they are gone
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------ torchrun
def torchrun(module: str, argv: Sequence[str], nproc: int, timeout: float | None = None,
             env: Mapping[str, str] | None = None, *, defaults: Mapping[str, str] | None = None,
             capture: bool = True, watch: Callable[[], float | None] | None = None) -> tuple[int, str]:
    """Run ``module`` with ``argv`` on ``nproc`` local ranks under torchrun; returns ``(exit code, output)``.

    The job's environment is this process's plus ``env``; each of ``defaults`` and ``OMP_NUM_THREADS``
    (the cores divided by ``nproc``) is set where neither gives it.  ``capture``: the output is stdout and
    stderr together; otherwise the job writes to this process's streams as it goes and the output is ``""``.

    The exit code is torchrun's, ``128 + N`` when a signal ``N`` ended it, :data:`TIMEOUT_RC` when it ran
    past ``timeout`` seconds (torchrun and every rank are ended; the output up to then is returned).
    ``watch`` is called every :data:`POLL_S` while the job runs; a number back ends the job with that
    grace in seconds, and the exit code is then torchrun's, or 1 where that was 0.  Ranks that outlive
    torchrun are ended too; nothing of the job is left running on any way out, exceptions included.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "-m", module, *argv]
    child_env = dict(os.environ, **(env or {}))
    for key, value in (defaults or {}).items():
        child_env.setdefault(key, value)
    child_env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, env=child_env, start_new_session=True, stdout=pipe,
                            stderr=subprocess.STDOUT if capture else None)
    chunks: list[bytes] = []

    def read() -> None:  # drains the pipe while the job runs, so a full pipe never blocks it
        while chunk := proc.stdout.read1(65536):
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True) if capture else None
    if reader is not None:
        reader.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    known: set[int] = set()
    try:
        polls = 0
        while True:
            try:
                rc = proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            polls += 1
            if polls % 5 == 1:  # once a second: remember the ranks, in case torchrun goes first
                known |= descendants(proc.pid)
            if deadline is not None and time.monotonic() > deadline:
                end_tree(proc, TIMEOUT_GRACE_S, known)
                rc = TIMEOUT_RC
                break
            grace = watch() if watch is not None else None
            if grace is not None:
                end_tree(proc, grace, known)
                rc = proc.returncode or 1
                break
        if any(alive(p) for p in known):
            end_tree(proc, EXIT_GRACE_S, known)
    finally:
        if proc.poll() is None or any(alive(p) for p in known):
            end_tree(proc, 0.5, known)
        if reader is not None:
            reader.join(timeout=10)
            proc.stdout.close()
    output = b"".join(chunks).decode(errors="replace")
    return (128 - rc if rc < 0 else rc), output


# ------------------------------------------------------------------------------- measured commands
MEASURE_POLL_S = 0.25  # how often :func:`run_measured` samples the job's processes (VmHWM keeps each peak between)


@dataclasses.dataclass
class Measured:
    """What :func:`run_measured` saw of a command.

    ``peak_rss_bytes``: the largest of ``process_peaks``. Each is the kernel's high-water mark (``VmHWM``)
    read at the last sample before the process ended, so only growth in its last :data:`MEASURE_POLL_S`
    can escape it. (``wait4``'s ``ru_maxrss`` cannot stand in: a child's count starts from the size of
    the process it was forked from, so a command started by a large process reports that process's size.)
    ``process_peaks``: each process's peak (``VmHWM``) as last sampled, by pid, the command's own first;
    ``child_pids``: the command's direct children seen (a torchrun job's ranks).
    """

    returncode: int
    output: str
    wall_s: float
    peak_rss_bytes: int
    process_peaks: dict[int, int]
    child_pids: list[int] = dataclasses.field(default_factory=list)
    timed_out: bool = False  # ran past its timeout (killed; exit code :data:`TIMEOUT_RC`)
    over_memory: bool = False  # a process's resident memory passed the limit (killed)


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB; (0, 0) when it is gone."""
    rss = hwm = 0
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return rss, hwm


def _started(pid: int) -> str:
    """The start time of ``pid`` (field 22 of ``/proc/<pid>/stat``), ``""`` when it is gone."""
    with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]
    return ""


def run_measured(command: Sequence[str], cwd: str | os.PathLike | None = None, env: Mapping[str, str] | None = None,
                 timeout: float | None = None, rss_limit_bytes: int | None = None) -> Measured:
    """Run ``command`` to its end (stdout and stderr together) and measure its memory.

    Every :data:`MEASURE_POLL_S` the command's process tree is sampled; past ``timeout`` seconds, or as soon
    as one process's resident memory passes ``rss_limit_bytes``, the command and every descendant are
    killed (torchrun puts its ranks in sessions of their own: they are killed by pid).
    """
    start = time.monotonic()
    peaks: dict[int, int] = {}
    children: set[int] = set()
    stop = threading.Event()
    why: list[str] = []

    def sample() -> None:
        known: dict[int, str] = {}  # pid -> its start time: a pid the system reused is not ours

        def ours() -> set[int]:
            return {pid for pid, started in known.items() if alive(pid) and _started(pid) == started}

        def kill_all() -> None:
            for _ in range(2):  # a rank forked while the first round was sent
                known.update({pid: _started(pid) for pid in descendants(proc.pid)})
                _signal_all(ours(), signal.SIGKILL)

        while True:  # the first sample at once: a short command is seen too
            tree = _children_map()
            children.update(tree.get(proc.pid, []))
            for pid in {proc.pid} | descendants(proc.pid, tree):
                known.setdefault(pid, _started(pid))
            for pid in ours():
                rss, hwm = memory_kib(pid)
                if hwm:
                    peaks[pid] = max(peaks.get(pid, 0), hwm * 1024)
                if rss_limit_bytes is not None and rss * 1024 > rss_limit_bytes and not why:
                    why.append("memory")
            if timeout is not None and time.monotonic() - start > timeout and not why:
                why.append("timeout")
            if why:
                kill_all()
            if stop.wait(MEASURE_POLL_S):
                break
        known.pop(proc.pid, None)  # reaped below; what is left are ranks outliving their torchrun
        _signal_all(ours(), signal.SIGKILL)

    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(list(command), cwd=cwd, env=None if env is None else dict(env), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            _, status = os.waitpid(proc.pid, 0)
        finally:
            stop.set()
            sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        output = out.read().decode(errors="replace")
    wall = time.monotonic() - start
    ordered = {proc.pid: peaks.pop(proc.pid, 0), **peaks}
    peak = max(ordered.values())
    rc = TIMEOUT_RC if why == ["timeout"] else proc.returncode
    rc = 128 - rc if rc < 0 else rc
    return Measured(rc, output, wall, peak, ordered, sorted(children), timed_out=why == ["timeout"],
                    over_memory=why == ["memory"])


# ------------------------------------------------------------------------------------- spawned ranks
class RankFailed(RuntimeError):
    """A rank of :func:`spawn_ranks` raised, died, or gave no result within the timeout.

    ``rank``: the first rank found failing; ``error``: ``"<ExceptionType>: <message>"`` (or what ended
    it); ``traceback``: the rank's formatted traceback (``""`` when it had none); ``results``: the return
    values that had arrived, by rank; ``timed_out``: no rank failed, some gave no result in time.
    """

    def __init__(self, rank: int, error: str, traceback: str = "", results: dict[int, Any] | None = None,
                 timed_out: bool = False) -> None:
        super().__init__(f"rank {rank}: {error}" + (f"\n{traceback}" if traceback else ""))
        self.rank, self.error, self.traceback = rank, error, traceback
        self.results = dict(results or {})
        self.timed_out = timed_out


def _rank_entry(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist

    try:
        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        value = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent, never a hang
        results.put((rank, False, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    else:
        results.put((rank, True, value, ""))
    finally:
        results.close()
        results.join_thread()  # in the pipe before the group goes: a peer's error follows this rank's
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(world: int, fn: Callable, args: tuple = (), *, timeout: float) -> list[Any]:
    """``fn(*args)`` on ``world`` fresh spawned processes; their return values, in rank order.

    Each rank has ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` set and, when ``world > 1``, the default process group up (gloo over TCP on 127.0.0.1).
    ``fn``, ``args`` and the return values are pickled.  Raises :class:`RankFailed` as soon as a rank
    raises or exits without a result (the other ranks are killed), or after ``timeout`` seconds without
    every result.
    """
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_entry, args=(r, world, port, fn, tuple(args), results)) for r in range(world)]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world:
            try:
                rank, ok, value, tb = results.get(timeout=POLL_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in values and p.exitcode is not None]
                if dead and _drained(results):
                    code = procs[dead[0]].exitcode
                    raise RankFailed(dead[0], f"exited with code {code} without a result", results=values) from None
                if time.monotonic() > deadline:
                    missing = min(set(range(world)) - set(values))
                    raise RankFailed(missing, f"gave no result within {timeout:.0f} s", results=values,
                                     timed_out=True) from None
                continue
            if not ok:
                raise RankFailed(rank, value, tb, results=values)
            values[rank] = value
        for proc in procs:
            proc.join(timeout=JOIN_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        results.close()
    return [values[r] for r in range(world)]


def _drained(results: Any) -> bool:
    """Nothing more in ``results`` right now (a rank's last message is in the pipe before it exits)."""
    time.sleep(POLL_S)
    return results.empty()
