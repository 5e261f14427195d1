"""Model-state offload through the main job (``megatron-longctx run``): at CP=2 ring with Megatron's full
recompute, checkpoint offload and the tiled loss with its recompute on (the final norm then runs inside the
output layer's call, in the output's unit), three steps with ``--longctx-model-state-offload host`` and ``disk``
give the losses and gradient norms of the same run without it (float32), so DDP's buffers, its gradient
reduction over the context-parallel ranks and the optimizer's update all see the streamed states; with
``disk`` the main job's resume check reloads the checkpoint into the files and reproduces steps 2 and 3.  Step 1
runs at learning rate 0 (warm-up), so steps 2 and 3 are what show the updated off-device weights.  Rank 0's
"memory features:" line names the model states and where they went.  A disk filled in the middle of a
``disk`` run stops it with one error naming the flag, and its last checkpoint resumes it.
"""

import errno
import os
import signal

import pytest
import torch

from tests import tmpfs
from tests.job import main_job

ARGS = ["--num-layers", "2", "--normalization", "RMSNorm", "--swiglu", "--train-iters", "3",
        "--longctx-offload-min-bytes", "0", "--no-baseline",
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
        "--longctx-offload-policy", "checkpoint", "--longctx-offload-target", "disk",
        "--longctx-tiled-loss-tiles", "2", "--longctx-tiled-loss-recompute"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    main_job.skip_without_megatron_training()
    return tmp_path_factory.mktemp("model-states")


def _train(root, name, *extra):
    out = str(root / name)
    proc = main_job.run(out, str(root / "data"), *ARGS, *(extra or ("--no-resume-check",)))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [r for r in main_job.metrics(out) if r["run"] == "plugin-cp2"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    return proc.stdout, rows


@pytest.fixture(scope="module")
def reference(root):
    return _train(root, "without")[1]


@pytest.mark.parametrize("target, distributed", [("host", False), ("disk", False), ("disk", True)],
                         ids=["host", "disk", "disk-distributed-optimizer"])
def test_model_state_offload_equals_the_run_without(root, reference, target, distributed):
    """(``--use-distributed-optimizer``: each of the two context-parallel ranks keeps half of Adam's moments,
    the updated halves gathered after the step, the checkpoint saved from every rank's.)"""
    resume = ["--resume-check-steps", "2"] if target == "disk" else ["--no-resume-check"]
    sharded = ("--use-distributed-optimizer",) if distributed else ()
    stdout, rows = _train(root, target + "-sharded" * distributed, "--longctx-model-state-offload", target,
                          *sharded, *resume)
    if target == "disk":  # checkpoints written from and loaded into the files: resume equals the straight run
        assert "resume from iteration 1: reproduces steps [2, 3] bit for bit" in stdout, stdout[-3000:]
    described = next(line for line in stdout.splitlines() if "memory features:" in line)
    assert "model states: weights and gradients streamed per layer through 2 slots of" in described, described
    assert f"off-device copy in {target}" in described and "offload: checkpoint to disk" in described, described
    assert ("optimizer states sharded over 2 data x context parallel ranks" in described) == distributed, described
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in rows], dtype=torch.float64),
                                   torch.tensor([r[key] for r in reference], dtype=torch.float64),
                                   rtol=1e-6, atol=0)


def test_disk_under_bf16_resumes_bit_for_bit_and_trains_as_without(root):
    """``--bf16`` with ``disk``: the float32 masters in files beside the bf16 weights; the checkpoint writes them
    from the files and loads them back into the files, and the resume check reproduces steps 2 and 3 bit for
    bit; the losses are those of the bf16 run without the offload, to bf16's rounding."""
    _, without = _train(root, "bf16-without", "--bf16", "--no-resume-check")
    stdout, rows = _train(root, "bf16-disk", "--bf16", "--longctx-model-state-offload", "disk",
                          "--resume-check-steps", "2")
    assert "resume from iteration 1: reproduces steps [2, 3] bit for bit" in stdout, stdout[-3000:]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in rows], dtype=torch.float64),
                                   torch.tensor([r[key] for r in without], dtype=torch.float64),
                                   rtol=1e-5, atol=0)


def test_disk_filled_during_the_run_names_the_flag_and_the_last_checkpoint_resumes(root, reference, tmp_path):
    """A real fault: the model states' disk directory (a small tmpfs) is filled while iteration 1 is saved, so
    step 2's optimizer cannot write Adam's moments beside the previous ones.  The job stops with one error
    naming the flag, the path and the bytes (nothing hangs), and the checkpoint of iteration 1 loads: the
    same job resumed from it trains steps 2 and 3 as the run without the offload does."""
    out, ckpt, data = str(tmp_path / "run"), str(tmp_path / "ckpt"), str(root / "data")
    job = (*ARGS, "--longctx-offload-target", "host", "--longctx-model-state-offload", "disk",
           "--save", ckpt, "--no-resume-check")
    with tmpfs.mounted(tmp_path / "small", "size=64m", otherwise="tests/memory/test_offdevice_optimizer.py fills "
                       "a file-size limit in a step without a checkpoint") as small:
        proc = main_job.start(out, data, *job, "--longctx-offload-disk-dir", str(small))
        # Iteration 1's folder appears once step 1 (its optimizer's first write included) is done and step 2
        # has not begun: stop both ranks there, fill the disk, and let them go on.
        main_job.wait_for(lambda: os.path.isdir(os.path.join(ckpt, "iter_0000001")), 300,
                          "the save of iteration 1", proc, poll=0.002)
        ranks = [main_job.rank_pid(proc.pid, r) for r in (0, 1)]
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        filled = _fill(str(small))
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        proc.wait(timeout=300)
        log = main_job.output(proc)
    assert filled > 0 and proc.returncode != 0, log[-4000:]
    failed = [line for line in log.splitlines() if "No space left on device" in line or "ENOSPC" in line]
    assert failed and "--longctx-offload-disk-dir" in failed[-1] and str(small) in failed[-1], log[-4000:]
    assert "bytes" in failed[-1] and "adamw-moments.bin.tmp" in failed[-1], failed[-1]  # Adam's next moments
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as fh:  # Megatron's tracker
        assert fh.read().strip() == "1"
    first = [r for r in main_job.metrics(out) if r["run"] == "plugin-cp2"]
    assert [r["step"] for r in first] == [1]

    again = main_job.run(str(tmp_path / "resumed"), data, *job, "--load", ckpt)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    rows = first + [r for r in main_job.metrics(str(tmp_path / "resumed")) if r["run"] == "plugin-cp2"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in rows], dtype=torch.float64),
                                   torch.tensor([r[key] for r in reference], dtype=torch.float64),
                                   rtol=1e-6, atol=0)


def _fill(folder: str) -> int:
    """Bytes written into ``folder`` until its filesystem is full."""
    written, block = 0, b"\0" * (1 << 20)
    with open(os.path.join(folder, "filler"), "wb", buffering=0) as fh:
        while True:
            try:
                written += fh.write(block)
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
                return written
