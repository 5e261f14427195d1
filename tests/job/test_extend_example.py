"""examples/extend_llama3_8b.sh with a recording ``torchrun``: each stage gets the planner's layout for its length,
its own RoPE base, and the previous stage's checkpoint (weights only); a finished stage is skipped."""

import os
import subprocess
import sys

from megatron_longctx.plan import presets
from megatron_longctx.plan.efficiency import resolve
from megatron_longctx.plan.flags import all_flags
from megatron_longctx.plan.recommend import recommend
from tests.job.main_job import ROOT, env


def _run(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "torchrun").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/call$$.txt\necho >> "
                                      f"{tmp_path}/calls.txt $$\n")
    (bin_dir / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    for tool in ("torchrun", "python"):
        os.chmod(bin_dir / tool, 0o755)
    e = dict(env(), PATH=f"{bin_dir}:{os.environ['PATH']}", SOURCE=str(tmp_path / "source"),
             OUTPUT_DIR=str(tmp_path / "out"), MEGATRON_LM="/opt/Megatron-LM")
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "extend_llama3_8b.sh")], env=e, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    pids = (tmp_path / "calls.txt").read_text().split()
    return proc, [(tmp_path / f"call{pid}.txt").read_text().splitlines() for pid in pids]


def _value(argv, flag):
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]  # the last one given wins in Megatron's parser


def test_stages_take_the_planners_layouts_and_hand_off(tmp_path):
    _, calls = _run(tmp_path)
    assert len(calls) == 3
    hw = presets.gpu("h200")
    sources = [str(tmp_path / "source"), str(tmp_path / "out" / "stage1-8192"), str(tmp_path / "out" / "stage2-131072")]
    for argv, length, base, source in zip(calls, (8192, 131072, 1 << 20), ("500000", "8000000", "128000000"), sources):
        plan = recommend(presets.model("llama3-8b"), length, 8, hw, eff=resolve(hw.family, "auto", False))
        flags = all_flags(plan)
        start = argv.index(flags[0])
        assert argv[start:start + len(flags)] == flags
        assert _value(argv, "--rotary-base") == base and _value(argv, "--seq-length") == str(length)
        assert _value(argv, "--load") == source and "--finetune" in argv
    # stage 1 finished: a second run skips it and starts stage 2 from it
    (tmp_path / "calls.txt").unlink()
    os.makedirs(tmp_path / "out" / "stage1-8192")
    (tmp_path / "out" / "stage1-8192" / "latest_checkpointed_iteration.txt").write_text("200")
    proc, calls = _run(tmp_path)
    assert "stage 1 (8192 tokens): done" in proc.stdout and len(calls) == 2
