"""The recipes in examples/: their flags parse, and their header comments are the planner's output."""

from __future__ import annotations

import argparse
import os
import re
import shlex

import pytest

from megatron_longctx.plan import presets
from megatron_longctx.plan.flags import longctx_flags
from megatron_longctx.plan.model import GIB
from megatron_longctx.plan.recommend import describe, recommend

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
RECIPES = {"llama3_8b_128k.sh": ("llama3-8b", 131072, 8), "llama3_8b_1m.sh": ("llama3-8b", 1 << 20, 8),
           "llama3_70b_1m.sh": ("llama3-70b", 1 << 20, 64)}
SUBSTITUTE = {'"$TRAIN_ITERS"': "20", '"$OUTPUT_DIR/checkpoints"': "runs/ckpt", '"$OUTPUT_DIR/tensorboard"': "runs/tb",
              '"${DATA_ARGS[@]}"': "--mock-data --tokenizer-type NullTokenizer --vocab-size 128255", '"$@"': ""}


def _training_args(text: str) -> list[str]:
    """The arguments after pretrain_gpt.py in the recipe's torchrun command."""
    command = text[text.index("torchrun"):].replace("\\\n", " ")
    for var, value in SUBSTITUTE.items():
        command = command.replace(var, value)
    tokens = shlex.split(command.splitlines()[0])
    return tokens[tokens.index('$MEGATRON_LM/pretrain_gpt.py') + 1:]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_comment_is_the_planner_output(name):
    text = open(os.path.join(EXAMPLES, name), encoding="utf-8").read()
    model, seq, gpus = RECIPES[name]
    plan = recommend(presets.model(model), seq, gpus, presets.gpu("h200"))
    assert f"recommended: {describe(plan)}" in text
    assert f"predicted peak {plan.memory.peak / GIB:.1f} GiB" in text
    args = _training_args(text)
    assert args[args.index("--context-parallel-size") + 1] == str(plan.parallel.cp)
    assert args[args.index("--tensor-model-parallel-size") + 1] == str(plan.parallel.tp)
    flags = longctx_flags(plan)
    start = args.index(flags[0])
    assert args[start:start + len(flags)] == flags


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_flags_parse_with_megatron(name):
    training = pytest.importorskip("megatron.training.arguments", reason="megatron-core < 0.19 ships no megatron.training")
    from megatron_longctx.megatron.args import add_longctx_args, config_from_args

    parser = add_longctx_args(training.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    args = parser.parse_args(_training_args(open(os.path.join(EXAMPLES, name), encoding="utf-8").read()))
    assert args.seq_length == RECIPES[name][1] and args.bf16 and args.use_distributed_optimizer
    config_from_args(args)  # the --longctx-* values validate together


def test_cpu_demo_runs_the_main_job():
    text = open(os.path.join(EXAMPLES, "cpu_demo.sh"), encoding="utf-8").read()
    assert re.search(r'exec "\$\{run\[@\]\}" run ', text)
