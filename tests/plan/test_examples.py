"""The recipes in examples/: their flags parse, and their header comments are the planner's output for them."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

import pytest

from megatron_longctx.plan import recipes
from megatron_longctx.plan.recommend import evaluate

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
RECIPES = {"llama3_8b_128k.sh": ("llama3-8b", 131072, 8), "llama3_8b_1m.sh": ("llama3-8b", 1 << 20, 8),
           "llama3_70b_1m.sh": ("llama3-70b", 1 << 20, 64)}


def _text(name: str) -> str:
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as fh:
        return fh.read()


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_header_is_the_planner_output_for_its_flags(name):
    text = _text(name)
    assert recipes.regenerate(text) == text, (
        f"examples/{name}: stale planner header; run python -m megatron_longctx.plan.recipes examples/{name}")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_is_read_from_its_command_line(name):
    text = _text(name)
    plan = recipes.recipe_plan(text)
    model, seq, gpus = RECIPES[name]
    assert (plan.model.name, plan.seq_length, plan.num_gpus) == (model, seq, gpus)
    args = recipes.training_args(text)
    assert args[args.index("--context-parallel-size") + 1] == str(plan.parallel.cp)
    assert args[args.index("--tensor-model-parallel-size") + 1] == str(plan.parallel.tp)
    assert plan.options.dataloader_mask == ("--no-create-attention-mask-in-dataloader" not in args)
    # The recipe's layout fits one H200 per rank once Megatron's dense dataloader mask is off.
    off = evaluate(plan.model, seq, gpus, plan.hardware, plan.parallel,
                   dataclasses.replace(plan.options, dataloader_mask=False))
    assert off.fits


def test_regenerate_rewrites_only_the_header(tmp_path):
    text = _text("llama3_8b_1m.sh")
    stale = re.sub(r"predicted peak [^\n]*", "predicted peak 1.0 GiB", text)
    path = tmp_path / "recipe.sh"
    path.write_text(stale)
    assert recipes.main(["--check", str(path)]) == 1
    assert recipes.main([str(path)]) == 0
    assert path.read_text() == text
    body = text[text.index("set -euo pipefail"):]
    assert recipes.regenerate(text).endswith(body)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_flags_parse_with_megatron(name):
    training = pytest.importorskip("megatron.training.arguments", reason="megatron-core < 0.19 ships no megatron.training")
    from megatron_longctx.megatron.arguments import add_longctx_args, config_from_args

    parser = add_longctx_args(training.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    args = parser.parse_args(recipes.training_args(_text(name)))
    assert args.seq_length == RECIPES[name][1] and args.bf16 and args.use_distributed_optimizer
    config_from_args(args)  # the --longctx-* values validate together


def test_cpu_demo_runs_the_main_job(tmp_path):
    argv = _recorded_run("cpu_demo.sh", tmp_path, "--seq-length", "16384")
    assert argv == ["run", "--output-dir", "runs/cpu_demo", "--seq-length", "16384"]


def _recorded_run(name: str, tmp_path, *extra: str) -> list[str]:
    """The arguments ``examples/<name> extra...`` gives ``megatron-longctx`` last (a recording one on
    ``PATH``)."""
    import subprocess

    bin_dir, record = tmp_path / "bin", tmp_path / "argv"
    bin_dir.mkdir()
    stub = bin_dir / "megatron-longctx"
    stub.write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$RECORD"\n')
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", RECORD=str(record),
               OUTPUT_DIR=str(tmp_path / "out"))
    subprocess.run(["bash", os.path.join(EXAMPLES, name), *extra], env=env, check=True, timeout=60)
    return record.read_bytes().decode().split("\0")[:-1]


def test_cpu_1m_flags_parse_with_megatron_and_the_main_job(tmp_path):
    training = pytest.importorskip("megatron.training.arguments",
                                   reason="megatron-core < 0.19 ships no megatron.training")
    from megatron_longctx.job import command_line, pretrain
    from megatron_longctx.megatron.arguments import add_longctx_args, config_from_args

    argv = _recorded_run("cpu_1m.sh", tmp_path)
    assert argv[0] == "run"
    own, megatron_argv = pretrain.build_parser().parse_known_args(argv[1:])
    assert own.nproc_per_node == 2 and own.no_baseline and own.no_resume_check
    parser = add_longctx_args(training.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    args = parser.parse_args(command_line.DEFAULTS + megatron_argv)  # a flag Megatron no longer has exits here
    assert args.seq_length == 1 << 20 and args.max_position_embeddings == 1 << 20
    assert args.context_parallel_size == 2 and args.train_iters == 1 and args.global_batch_size == 1
    cfg = config_from_args(args)
    assert cfg.memory.offload_target == "disk" and cfg.memory.offload_disk_dir == str(tmp_path / "out" / "offload")
    job = command_line.Job.from_argv(megatron_argv, own)  # the main job's own checks, before any rank starts
    assert job.shape()["seq_length"] == 1 << 20 and job.context_parallel_size == 2
