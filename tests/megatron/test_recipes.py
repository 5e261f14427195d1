"""Each GPU recipe in examples/ trains through Megatron-LM's real pretrain_gpt.py on CPU with its own flag set,
shrunk only in model size, sequence length and the number of ranks (2 CPU ranks instead of 8-64 GPUs).

The recipe script itself runs, with a ``torchrun`` on ``PATH`` that records its arguments; the test
then shrinks those and runs them through the launcher.
"""

from __future__ import annotations

import math
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.megatron_lm import REPO, copy_scripts, require_scripts, require_training, run_script

# extend_*.sh runs several launcher stages (tests/job/test_extend_example.py holds it), not one recipe
RECIPES = sorted(p.name for p in (REPO / "examples").glob("*.sh")
                 if "megatron_longctx.launch" in p.read_text() and not p.name.startswith("extend_"))

# Values that make a recipe fit two CPU ranks; every other flag of the recipe is kept as it is.
SHRINK = {
    "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128", "--num-attention-heads": "4",
    "--num-query-groups": "2", "--kv-channels": "16", "--seq-length": "256", "--max-position-embeddings": "256",
    "--vocab-size": "256", "--tensor-model-parallel-size": "1",
    "--train-iters": "3",  # more than the recipes' 2 warm-up iterations
}


def recipe_args(recipe: Path, tmp: Path, scripts: Path) -> list[str]:
    """The arguments the recipe gives ``pretrain_gpt.py`` (after ``-m megatron_longctx.launch <script>``)."""
    bin_dir, record = tmp / "bin", tmp / "argv"
    bin_dir.mkdir()
    torchrun = bin_dir / "torchrun"
    torchrun.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$RECIPE_ARGV"\n')
    torchrun.chmod(torchrun.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", RECIPE_ARGV=str(record),
               MEGATRON_LM=str(scripts), OUTPUT_DIR=str(tmp / "out"))
    env.pop("DATA_PATH", None)  # mock data
    subprocess.run(["bash", str(recipe)], env=env, check=True, cwd=tmp, timeout=60)
    argv = record.read_bytes().decode().split("\0")[:-1]
    at = argv.index("megatron_longctx.launch")
    assert argv[at + 1] == str(scripts / "pretrain_gpt.py")
    return argv[at + 2:]


def shrink(args: list[str]) -> list[str]:
    args = list(args)
    for flag, value in SHRINK.items():
        if flag in args:
            args[args.index(flag) + 1] = value
    if "--context-parallel-size" in args:
        at = args.index("--context-parallel-size") + 1
        args[at] = "2" if int(args[at]) > 1 else "1"
    return args


def test_every_gpu_recipe_is_found():
    assert {"llama3_8b_128k.sh", "llama3_8b_1m.sh", "llama3_70b_1m.sh"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_on_cpu(recipe, tmp_path):
    require_scripts()
    require_training()
    script = copy_scripts(tmp_path / "megatron_lm")
    args = recipe_args(REPO / "examples" / recipe, tmp_path, script.parent)
    assert "--no-create-attention-mask-in-dataloader" in args  # the recipes never build the dense mask
    run = run_script(script, shrink(args)).check()
    print(f"{recipe}: {run.wall_s:.1f} s")
    assert [row["iteration"] for row in run.losses] == [1, 2, 3]
    assert all(math.isfinite(row["lm loss"]) and row["lm loss"] > 0 for row in run.losses)
