"""The Megatron-Bridge recipes in examples/: each states the layout of a Megatron-LM recipe whose header holds
the planner's numbers, and its overrides and --longctx-* flags are fields Bridge's ConfigContainer has."""

from __future__ import annotations

import os
import re
import shlex

import pytest

from tests.bridge.bridge_kit import bridge_available, import_bridge

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
BRIDGE_RECIPES = sorted(n for n in os.listdir(EXAMPLES) if n.startswith("bridge_") and n.endswith(".sh"))
# Bridge override -> the Megatron-LM flag of the same setting
SAME_SETTING = {"model.tensor_model_parallel_size": "--tensor-model-parallel-size",
                "model.context_parallel_size": "--context-parallel-size", "model.cp_comm_type": "--cp-comm-type",
                "model.seq_length": "--seq-length", "model.recompute_granularity": "--recompute-granularity"}


def _text(name: str) -> str:
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as fh:
        return fh.read()


def bridge_args(text: str) -> list[str]:
    """The arguments after ``-m megatron_longctx.bridge`` in the recipe's torchrun command, variables filled."""
    command = text[text.index("torchrun"):].replace("\\\n", " ").splitlines()[0]
    seq = re.search(r"^SEQ=(\d+)$", text, re.M).group(1)
    for var, value in (("$SEQ", seq), ("$TRAIN_ITERS", "2"), ("$OUTPUT_DIR", "/tmp/out"), ('"$@"', "")):
        command = command.replace(var, value)
    tokens = shlex.split(command)
    return tokens[tokens.index("megatron_longctx.bridge") + 1:]


def _lm_recipe(text: str) -> str:
    return re.search(r"the layout of (\S+\.sh)", text).group(1)


@pytest.mark.parametrize("name", BRIDGE_RECIPES)
def test_header_is_the_megatron_lm_recipes_planner_output(name):
    text = _text(name)
    lm = _text(_lm_recipe(text))
    layout = re.search(r"#   (TP\d+ CP\d+ \(\w+\) DP\d+, [^;]+);", text).group(1)
    assert f"this recipe: {layout}; " in lm.replace("\n#     ", " ")
    peak, step = re.search(r"#   (predicted peak [^,]+), (predicted step .+\))$", text, re.M).groups()
    assert f"#   {peak}\n" in lm and f"#   {step}," in lm


@pytest.mark.parametrize("name", BRIDGE_RECIPES)
def test_settings_match_the_megatron_lm_recipe(name):
    from megatron_longctx.plan import recipes

    text = _text(name)
    args = bridge_args(text)
    lm_args = recipes.training_args(_text(_lm_recipe(text)))
    overrides = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("--"))
    for key, flag in SAME_SETTING.items():
        want = lm_args[lm_args.index(flag) + 1] if flag in lm_args else "null"
        assert overrides[key] == want, (key, flag)
    for flag in ("--longctx-cp-algorithm", "--longctx-tiled-mlp-tiles", "--longctx-tiled-loss-tiles"):
        got = args[args.index(flag) + 1] if flag in args else None
        assert got == (lm_args[lm_args.index(flag) + 1] if flag in lm_args else None), flag


@pytest.mark.skipif(bridge_available() is not None, reason=str(bridge_available()))
@pytest.mark.parametrize("name", BRIDGE_RECIPES)
def test_overrides_and_flags_are_fields_of_bridges_config(name):
    """Applied to Bridge's vanilla_gpt recipe (the Llama recipes load their config from the Hugging Face hub):
    every override names a ConfigContainer field and every --longctx-* flag parses."""
    import_bridge()
    from megatron_longctx.bridge import LongContextLayerSpec
    from megatron_longctx.bridge.__main__ import build_config

    args = bridge_args(_text(name))
    recipe = args.index("--recipe")
    args[recipe + 1] = "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config"
    cfg, _ = build_config(args)
    overrides = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("--"))
    assert str(cfg.model.context_parallel_size) == overrides["model.context_parallel_size"]
    assert str(cfg.dataset.seq_length) == overrides["dataset.seq_length"]
    assert isinstance(cfg.model.transformer_layer_spec, LongContextLayerSpec)
