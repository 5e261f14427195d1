"""Local launches: a free port binds, torchrun jobs return their exit code and output and never outlive
a timeout, spawned ranks return every result and a raising rank ends the run at once with its traceback."""

import os
import socket
import sys
import textwrap
import time

import pytest

from megatron_longctx import procs


def test_procs_is_a_leaf():
    import ast

    with open(procs.__file__) as f:
        tree = ast.parse(f.read())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += ["." * n.level + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith(("megatron_longctx", "."))], names


def test_free_port_is_bindable():
    port = procs.free_port()
    assert 1024 <= port < 65536
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def _rank_value(scale):
    import torch
    import torch.distributed as dist

    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return {"rank": dist.get_rank(), "env_rank": int(os.environ["RANK"]), "world": dist.get_world_size(),
            "sum": total.item() * scale}


def _single_value(x):
    return x + 1


def _rank_one_raises():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # rank 0 waits here for a rank that is gone: only killing it ends the run
    return "unreachable"


def _rank_one_dies():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(7)
    time.sleep(600)  # rank 0 gives no sign of rank 1's death: the parent must see it
    return "unreachable"


def _rank_one_sleeps():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(600)
    return "done"


def test_spawn_ranks_returns_every_rank_result_in_order():
    out = procs.spawn_ranks(2, _rank_value, (10.0,), timeout=300)
    assert [(r["rank"], r["env_rank"], r["world"]) for r in out] == [(0, 0, 2), (1, 1, 2)]
    assert [r["sum"] for r in out] == [10.0, 10.0]  # the gloo group is up: 0 + 1 summed on both ranks
    assert procs.spawn_ranks(1, _single_value, (41,), timeout=300) == [42]


def test_a_raising_rank_ends_the_run_at_once_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(procs.RankFailed) as info:
        procs.spawn_ranks(2, _rank_one_raises, timeout=600)
    elapsed = time.monotonic() - start
    assert elapsed < 60, elapsed  # never waits out the timeout on the dead rank
    exc = info.value
    assert exc.rank == 1 and not exc.timed_out
    assert exc.error == "ValueError: rank one cannot go on"
    assert "_rank_one_raises" in exc.traceback and "rank one cannot go on" in str(exc)


def test_a_rank_that_dies_without_a_result_ends_the_run_at_once():
    start = time.monotonic()
    with pytest.raises(procs.RankFailed) as info:
        procs.spawn_ranks(2, _rank_one_dies, timeout=600)
    assert time.monotonic() - start < 60
    assert info.value.rank == 1 and "code 7" in info.value.error


def test_a_rank_without_a_result_times_out_with_the_others_results():
    with pytest.raises(procs.RankFailed) as info:
        procs.spawn_ranks(2, _rank_one_sleeps, timeout=45)
    assert info.value.timed_out and info.value.rank == 1 and info.value.results == {0: "done"}


def _module(tmp_path, name, body):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}


def test_torchrun_returns_the_exit_code_and_the_output(tmp_path):
    env = _module(tmp_path, "exits_three", """
        import os, sys
        print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} says {sys.argv[1:]}", flush=True)
        print("on stderr", file=sys.stderr, flush=True)
        sys.exit(3)
    """)
    rc, output = procs.torchrun("exits_three", ["--flag", "x"], 1, 300, env)
    assert rc == 1, output  # torchrun's own exit code for a failed rank; the rank's is in its summary
    assert "exitcode  : 3" in output
    assert "rank 0 of 1 says ['--flag', 'x']" in output
    assert "on stderr" in output


def test_torchrun_env_and_defaults(tmp_path, monkeypatch):
    env = _module(tmp_path, "prints_env", """
        import os
        if os.environ["RANK"] == "0":
            print("|".join(os.environ.get(k, "-") for k in ("A", "B", "C", "OMP_NUM_THREADS")), flush=True)
    """)
    monkeypatch.setenv("B", "from-environ")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    rc, output = procs.torchrun("prints_env", [], 1, 300, dict(env, A="given"),
                                defaults={"A": "default", "B": "default", "C": "default"})
    assert rc == 0, output
    assert f"given|from-environ|default|{max(1, os.cpu_count() or 1)}" in output


def test_torchrun_timeout_ends_every_process_and_returns_promptly(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = _module(tmp_path, "stalls", f"""
        import os, time
        open(os.path.join({str(pid_dir)!r}, str(os.getpid())), "w").close()
        print("started", flush=True)
        time.sleep(600)
    """)
    start = time.monotonic()
    rc, output = procs.torchrun("stalls", [], 2, 20, env)
    elapsed = time.monotonic() - start
    assert rc == procs.TIMEOUT_RC and elapsed < 60, (rc, elapsed, output[-2000:])
    assert "started" in output
    ranks = [int(p) for p in os.listdir(pid_dir)]
    assert len(ranks) == 2 and not [p for p in ranks if procs.alive(p)]


def test_torchrun_watch_ends_the_job(tmp_path):
    env = _module(tmp_path, "sleeps", """
        import time
        time.sleep(600)
    """)
    start = time.monotonic()
    calls = []

    def watch():
        calls.append(time.monotonic())
        return 0.5 if time.monotonic() - start > 5 else None

    rc, _ = procs.torchrun("sleeps", [], 1, 600, env, watch=watch)
    assert rc != 0 and time.monotonic() - start < 60 and calls


# A parent holding ``argv[1]`` MiB (touched, so resident) that starts a child in a session of its own (as
# torchrun starts its ranks) holding ``argv[2]`` MiB, prints the child's pid, then both sleep ``argv[3]`` s.
_HOLDER = textwrap.dedent("""
    import os, subprocess, sys, time
    mib, child_mib, sleep = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    hold = bytearray(mib << 20)
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; b = bytearray(%d << 20); "
                              "time.sleep(%f)" % (child_mib, sleep)], start_new_session=True)
    print("child pid", child.pid, flush=True)
    time.sleep(sleep)
    child.wait()
""")


def _child_pid(output):
    return int(next(line.split()[-1] for line in output.splitlines() if line.startswith("child pid")))


def test_run_measured_reports_the_largest_peak_and_each_child():
    m = procs.run_measured([sys.executable, "-c", _HOLDER, "200", "100", "1.5"])
    assert m.returncode == 0 and not m.timed_out and not m.over_memory, m.output
    assert 200 << 20 <= m.peak_rss_bytes < 400 << 20  # the parent's 200 MiB, not parent + child
    assert m.child_pids == [_child_pid(m.output)]
    assert m.process_peaks[m.child_pids[0]] >= 100 << 20  # sampled while it slept


def test_run_measured_is_not_charged_for_the_process_that_started_it():
    held = bytearray(600 << 20)  # the caller is large (a long pytest session); the command is not
    m = procs.run_measured([sys.executable, "-c", "import time; b = bytearray(50 << 20); time.sleep(0.6)"])
    assert m.returncode == 0, m.output
    assert 50 << 20 <= m.peak_rss_bytes < 300 << 20, (m.peak_rss_bytes, len(held))


@pytest.mark.parametrize("limit", ["timeout", "memory"])
def test_run_measured_kills_the_whole_tree_past_a_limit(limit):
    start = time.monotonic()
    if limit == "timeout":  # the timeout leaves the (slow, shared) machine time to start both processes first
        m = procs.run_measured([sys.executable, "-c", _HOLDER, "100", "50", "60"], timeout=8.0)
    else:  # the child, in a session of its own, passes the limit: its parent goes too
        m = procs.run_measured([sys.executable, "-c", _HOLDER, "50", "300", "60"], rss_limit_bytes=150 << 20)
    assert time.monotonic() - start < 30
    assert (m.timed_out, m.over_memory) == (limit == "timeout", limit == "memory")
    assert m.returncode == (procs.TIMEOUT_RC if limit == "timeout" else 128 + 9)
    assert m.peak_rss_bytes >= (100 << 20 if limit == "timeout" else 150 << 20)
    child = _child_pid(m.output)
    deadline = time.monotonic() + 10
    while procs.alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not procs.alive(child)  # in a session of its own, yet gone with its parent
