"""Checkpoints lose nothing: damaged ones are refused naming the file, existing ones are never clobbered,
and a rank killed in the middle of a save leaves the previous checkpoint loadable."""

import os
import shutil
import signal

import pytest

from megatron_longctx.job import checkpoint_guard as guard
from tests.job import main_job


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished tiny run: checkpoints at iterations 3 and 6."""
    out, data, _ = main_job.finished(tmp_path_factory, "ckpt", "--train-iters", "6", "--save-interval", "3",
                                     "--no-baseline", "--no-resume-check")
    return {"out": out, "data": data, "ckpt": os.path.join(out, "checkpoint")}


def _copy(trained, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(trained["ckpt"], ckpt)
    return ckpt


def _distcp(ckpt, iteration):
    folder = guard.iteration_dir(ckpt, iteration)
    return os.path.join(folder, sorted(f for f in os.listdir(folder) if f.endswith(".distcp"))[0])


def _damage(path, how):
    size = os.path.getsize(path)
    if how == "corrupt":  # 4 KiB of garbage in the middle, same size
        with open(path, "r+b") as f:
            f.seek(size // 2)
            f.write(os.urandom(4096))
        assert os.path.getsize(path) == size
    else:
        os.truncate(path, size // 2)


@pytest.mark.parametrize("how, says", [("corrupt", "does not match the checksum"), ("truncated", "truncated")])
def test_damaged_checkpoint_is_refused_naming_the_file(trained, tmp_path, how, says):
    ckpt = _copy(trained, tmp_path)
    bad = _distcp(ckpt, 6)
    assert os.path.getsize(bad) > 8192
    _damage(bad, how)
    proc = main_job.run(str(tmp_path / "run"), trained["data"], "--train-iters", "9", "--load", ckpt, "--save", ckpt,
                        "--no-baseline", "--no-resume-check")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert bad in proc.stderr and says in proc.stderr, proc.stderr
    assert "torch.distributed.run" not in proc.stdout + proc.stderr  # refused before any rank started
    assert not os.path.exists(os.path.join(str(tmp_path / "run"), "metrics.jsonl"))
    assert guard.saved_iterations(ckpt) == [3, 6] and guard.tracker_iteration(ckpt) == 6


def test_existing_checkpoint_is_not_touched_by_a_new_run(trained, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(trained["out"], out)
    ckpt = os.path.join(out, "checkpoint")
    before = {it: guard.verify(guard.iteration_dir(ckpt, it)) for it in (3, 6)}
    stamps = {p: os.stat(os.path.join(r, p)).st_mtime_ns for r, _, fs in os.walk(ckpt) for p in fs}
    proc = main_job.run(out, trained["data"], "--train-iters", "2", "--no-baseline", "--no-resume-check")
    assert proc.returncode == 2
    assert ckpt in proc.stderr and "--load" in proc.stderr and "--overwrite-checkpoint" in proc.stderr, proc.stderr
    assert {it: guard.verify(guard.iteration_dir(ckpt, it)) for it in (3, 6)} == before
    assert {p: os.stat(os.path.join(r, p)).st_mtime_ns for r, _, fs in os.walk(ckpt) for p in fs} == stamps
    assert guard.tracker_iteration(ckpt) == 6


def test_rank_killed_during_save_leaves_the_previous_checkpoint_loadable(trained, tmp_path):
    out, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    job = ("--train-iters", "9", "--save-interval", "3", "--save", ckpt, "--no-baseline", "--no-resume-check")
    # Stop rank 1 as soon as iteration 6's folder appears (iteration 3 is saved), then kill it.
    proc = main_job.start(out, trained["data"], *job)
    folder = guard.iteration_dir(ckpt, 6)
    main_job.wait_for(lambda: os.path.isdir(folder), 300, "the save of iteration 6", proc, poll=0.002)
    rank1 = main_job.rank_pid(proc.pid, 1)
    os.kill(rank1, signal.SIGSTOP)
    assert guard.tracker_iteration(ckpt) == 3 and not os.path.exists(os.path.join(folder, guard.MANIFEST))
    os.kill(rank1, signal.SIGKILL)
    proc.wait(timeout=120)
    assert proc.returncode != 0
    assert guard.tracker_iteration(ckpt) == 3 and not os.path.exists(os.path.join(folder, guard.MANIFEST))
    assert guard.resolve_load(ckpt) == (3, [])
    # The same job with --load resumes from 3 and finishes; the interrupted folder is kept aside, not reused.
    rerun = main_job.run(out, trained["data"], *job, "--load", ckpt)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert [r["step"] for r in main_job.metrics(out, "plugin-cp2")][-6:] == [4, 5, 6, 7, 8, 9]
    assert guard.saved_iterations(ckpt) == [3, 6, 9] and guard.tracker_iteration(ckpt) == 9
    assert all(guard.verify(guard.iteration_dir(ckpt, it)) for it in (3, 6, 9))
    assert any(name.startswith("iter_0000006.set-aside-") for name in os.listdir(ckpt))
