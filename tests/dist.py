"""The one spawn harness for distributed tests: N ranks as CPU processes under gloo.

A test writes the body that every rank runs as a plain module-level function ``fn(*args, **kwargs)``
and calls :func:`run_ranks`::

    def _body(dtype):                       # runs on every rank, process group already up
        ...assert_close(...)

    @pytest.mark.parametrize("world_size", [2, 4])
    def test_x(world_size):
        run_ranks(world_size, _body, torch.float64)

Ranks are spawned once per world size and reused by the following tests (starting Python with torch
and Megatron costs seconds per process; a suite spawns a pool a handful of times, not hundreds).  The
default process group is gloo over TCP on 127.0.0.1 with a free port.  A rank that raises reports its
traceback; after a short grace the others are judged too, every traceback reaches the pytest failure,
and the pool is torn down so the next test starts clean.  A test that runs past ``timeout`` seconds
kills all ranks and fails: a hang is a failure, never a stuck CI.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing as mp
import os
import queue
import traceback
from typing import Any, Callable

from megatron_longctx.procs import free_port, process_groups_released

DEFAULT_TIMEOUT_S = float(os.environ.get("LONGCTX_TEST_TIMEOUT", "240"))
_GRACE_S = 20.0  # how long the other ranks get to finish or fail once one rank has failed


def _worker(rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S),
        )
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, False, traceback.format_exc()))
        return
    environ = dict(os.environ)
    while True:
        try:
            task = tasks.get()
        except (EOFError, OSError):  # the test process is gone
            break
        if task is None:
            break
        fn, args, kwargs = task
        try:
            value = fn(*args, **kwargs)
            results.put((rank, True, value))
        except BaseException:  # noqa: BLE001
            results.put((rank, False, traceback.format_exc()))
        finally:  # a task's environment (e.g. the NVTE_* flags a Megatron model sets) does not reach the next
            _restore_environ(environ)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _restore_environ(saved: dict[str, str]) -> None:
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    os.environ.update(saved)


class RankFailure(AssertionError):
    """Raised in the test process; its message holds the traceback of every rank that failed."""


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results: mp.Queue = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results))
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        __tracebackhide__ = True
        for q in self.tasks:
            q.put((fn, args, kwargs))
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = _now() + timeout
        while len(values) + len(failures) < self.world_size:
            wait = deadline - _now()
            if failures:
                wait = min(wait, _GRACE_S)
            try:
                rank, ok, value = self.results.get(timeout=max(wait, 0.01))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in failures]
                for r in dead:
                    failures[r] = f"rank {r} died (exit code {self.procs[r].exitcode})"
                if failures or _now() >= deadline:
                    missing = [r for r in range(self.world_size) if r not in values and r not in failures]
                    reason = "did not finish after another rank failed" if failures else f"timed out after {timeout:.0f}s"
                    for r in missing:
                        failures[r] = f"rank {r} {reason} (killed)"
                    break
                continue
            (values if ok else failures)[rank] = value
        if failures:
            self.close(kill=True)
            report = "\n".join(f"----- rank {r} -----\n{failures[r]}" for r in sorted(failures))
            raise RankFailure(f"{len(failures)} of {self.world_size} ranks failed in {fn.__name__}:\n{report}")
        return [values[r] for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, kill: bool = False) -> None:
        if not kill:
            for q in self.tasks:
                with contextlib.suppress(Exception):
                    q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def _now() -> float:
    import time

    return time.monotonic()


_pools: dict[int, _Pool] = {}
# Ranks are not daemons (Megatron's checkpoint writer starts processes of its own); stop them at exit.
atexit.register(lambda: shutdown())


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return every rank's return value.

    ``fn`` must be a module-level function (it is pickled by reference).  Raises :class:`RankFailure`
    with all tracebacks when any rank raises, dies or runs past ``timeout``.
    """
    __tracebackhide__ = True
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(kill=True)
        # Keep at most one pool alive: the machine has few cores.
        for other in list(_pools):
            _pools.pop(other).close()
        pool = _pools[world_size] = _Pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except RankFailure:
        _pools.pop(world_size, None)
        raise


def shutdown() -> None:
    """Stop every pool (called at the end of the pytest session)."""
    for ws in list(_pools):
        _pools.pop(ws).close()


@contextlib.contextmanager
def megatron_parallel(tp: int = 1, cp: int = 1, pp: int = 1, **kwargs: Any):
    """Initialise Megatron's ``parallel_state`` with the given sizes on this rank, and tear it down.

    Use inside a rank body: ``with megatron_parallel(cp=2): ...``.  Extra keywords go to
    ``initialize_model_parallel`` (e.g. ``hierarchical_context_parallel_sizes``).
    """
    from megatron.core import parallel_state

    with process_groups_released():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp, **kwargs
        )
        try:
            yield parallel_state
        finally:
            parallel_state.destroy_model_parallel()
