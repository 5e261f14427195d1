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


def test_cpu_demo_runs_the_main_job():
    assert re.search(r'exec "\$\{run\[@\]\}" run ', _text("cpu_demo.sh"))
