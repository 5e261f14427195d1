"""``megatron-longctx extend``: stage 2 starts from stage 1's final checkpoint; a stage stopped part-way resumes
from its newest checkpoint and reproduces the uninterrupted stage bit for bit; bad stage lists are refused."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron_longctx.job import checkpoint_guard as guard
from megatron_longctx.job import extend
from tests.job import main_job
from tests.job.conftest import digest

SHAPE = main_job.TINY[:10]


def _extend(out, data, *flags):
    argv = [sys.executable, "-m", "megatron_longctx.cli", "extend", *SHAPE, "--data-dir", data, "--data-max-bytes",
            str(1 << 20), "--output-dir", out, "--stages", "128:2,256:3", "--rotary-base", "10000,40000",
            "--save-interval", "1", *flags]
    proc = subprocess.run(argv, env=main_job.env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_stage_hand_off_and_mid_stage_resume_are_exact(source, tmp_path):
    out = str(tmp_path / "extend")
    proc = _extend(out, source["data"], "--load", source["ckpt"])
    first, second = os.path.join(out, "stage1-128", "checkpoint"), os.path.join(out, "stage2-256", "checkpoint")
    assert guard.tracker_iteration(first) == 2 and guard.tracker_iteration(second) == 3
    # stage 1 from the source (weights only), stage 2 from stage 1's final iteration
    assert f"successfully loaded checkpoint from {source['ckpt']}" in proc.stdout
    assert f"successfully loaded checkpoint from {first} " in proc.stdout  # its tracker's iteration, 2
    assert digest(source["ckpt"]) == source["digest"]
    record = json.load(open(os.path.join(out, "extend.json")))["stages"]
    assert [(r["seq_length"], r["steps"], r["rotary_base"], r["context_parallel_size"]) for r in record] == \
        [(128, 2, "10000", 2), (256, 3, "40000", 2)]
    rows = main_job.metrics(os.path.join(out, "stage2-256"))
    assert [r["step"] for r in rows] == [1, 2, 3]

    # stopped after stage 2's first checkpoint: the later iterations gone, the tracker at 1
    for later in (2, 3):
        shutil.rmtree(guard.iteration_dir(second, later))
    with open(os.path.join(second, guard.TRACKER), "w") as f:
        f.write("1")
    proc = _extend(out, source["data"], "--load", source["ckpt"])
    assert "stage 1 (128 tokens) already done" in proc.stdout and "resuming at iteration 1" in proc.stdout
    resumed = main_job.metrics(os.path.join(out, "stage2-256"))[3:]
    assert [r["step"] for r in resumed] == [2, 3]
    for new, old in zip(resumed, rows[1:]):
        for key in ("loss", "grad_norm", "lr"):
            assert new[key] == old[key], (key, new, old)
    assert guard.tracker_iteration(second) == 3


@pytest.mark.parametrize("flags, named", [
    (["--stages", "8K:200,32K"], "--stages '8K:200,32K': '32K' is not LENGTH:STEPS[@SHORT:FRACTION]"),
    (["--stages", "32K:100,8K:200"], "the length shrinks from 32768 to 8192"),
    (["--stages", "8K:0"], "needs a length and steps >= 1"),
    (["--stages", "8K:2,16K:2", "--rotary-base", "1,2,3"], "--rotary-base '1,2,3': give one"),
    (["--stages", "8K:2", "--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt"),
])
def test_bad_stage_lists_are_refused_naming_the_flag(tmp_path, capsys, flags, named):
    assert extend.main(["--output-dir", str(tmp_path / "x"), *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("flags, named", [
    # the planner's layout for stage 1 (DP=8 over a global batch of 8) on 3 local ranks
    (["--stages", "8K:2,1M:1", "--plan-model", "llama3-8b", "--plan-gpus", "8", "--plan-gpu", "h200",
      "--nproc-per-node", "3"], "stage 1 (8192 tokens): --global-batch-size 8 must be a multiple of"),
    (["--stages", "8K:2,16K:2@1001:0.5", "--nproc-per-node", "2"],
     "stage 2 mixes 1001:0.5: the short length must be a multiple of 2 x"),
    (["--stages", "8K:2,16K:2", "--nproc-per-node", "2", "--num-attention-heads", "3"],
     "stage 1 (8192 tokens): --hidden-size"),
])
def test_every_stage_is_checked_as_run_checks_it_before_any_runs(tmp_path, capsys, flags, named):
    main_job.skip_without_megatron_training()
    assert extend.main(["--output-dir", str(tmp_path / "x"), *flags]) == 2
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megatron-longctx extend:")]
    assert len(ours) == 1 and named in ours[0], ours
    assert not os.path.exists(tmp_path / "x")


def test_stage_lengths_parse_with_units():
    assert extend.parse_stages("8K:200,32K:100,1M:5") == [(8192, 200, None), (32768, 100, None), (1 << 20, 5, None)]


def test_each_stage_takes_the_planners_layout_for_its_length():
    from megatron_longctx.plan import presets
    from megatron_longctx.plan.efficiency import resolve
    from megatron_longctx.plan.flags import all_flags
    from megatron_longctx.plan.recommend import recommend

    own, rest = extend.build_parser().parse_known_args(
        ["--stages", "8K:2,128K:2,1M:1", "--plan-model", "llama3-8b", "--plan-gpus", "8", "--plan-gpu", "h200",
         "--nproc-per-node", "8", "--output-dir", "/nonexistent/extend", "--lr", "1e-5"])
    stages = extend.parse_stages(own.stages)
    hw = presets.gpu("h200")
    layouts = set()
    for index, (length, _, _) in enumerate(stages):
        argv, record = extend.stage_argv(own, rest, index, stages, "8000000")
        plan = recommend(presets.model("llama3-8b"), length, 8, hw, eff=resolve(hw.family, "auto", False))
        assert argv[:len(all_flags(plan))] == all_flags(plan)  # the planner's flags first, the user's after them
        assert argv[argv.index("--context-parallel-size", len(all_flags(plan))) + 1] == str(plan.parallel.cp)
        last = len(argv) - 1 - argv[::-1].index("--rotary-base")  # the stage's base wins over the preset's
        assert argv[last + 1] == "8000000" and last > len(all_flags(plan)) and "--lr" in argv
        assert record["layout"].startswith("recommended: ") and record["state"] == "start"
        layouts.add(record["layout"])
    assert len(layouts) == 3  # 8K, 128K and 1M each get their own layout on 8 x H200
