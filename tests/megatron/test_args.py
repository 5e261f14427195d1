"""The --longctx-* flags: generated from the config dataclasses, parsed back, alongside Megatron's parser."""

import argparse
import dataclasses

import pytest

from megatron_longctx import add_longctx_args, config_from_args
from megatron_longctx.megatron.arguments import check_after_parsing
from megatron_longctx.attention import ALGORITHMS
from megatron_longctx.config import (
    FEATURES,
    MEGATRON_FLAGS,
    ContextParallelConfig,
    LongContextConfig,
    choices,
    flag_name,
)


def _all_fields():
    """The fields that are --longctx-* flags (the recompute_* ones are read from Megatron's --recompute-*)."""
    return [f for _, cls in FEATURES for f in dataclasses.fields(cls) if f.name not in MEGATRON_FLAGS]


def test_one_flag_per_field_with_defaults():
    parser = add_longctx_args(argparse.ArgumentParser())
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings and a.option_strings[0].startswith("--longctx-")}
    assert flags == {flag_name(f.name) for f in _all_fields()}
    args = parser.parse_args([])
    assert config_from_args(args) == LongContextConfig()
    assert add_longctx_args(parser) is parser  # adding twice is a no-op, not a clash


def test_values_round_trip():
    parser = add_longctx_args(argparse.ArgumentParser())
    args = parser.parse_args([
        "--longctx-cp-algorithm", "ulysses", "--longctx-cp-kernel-backend", "reference",
        "--longctx-tiled-mlp-tiles", "4", "--no-longctx-offload-prefetch", "--longctx-offload-modules", "core_attn,mlp",
    ])
    cfg = config_from_args(args)
    assert cfg.cp == ContextParallelConfig(cp_algorithm="ulysses", cp_kernel_backend="reference")
    assert cfg.memory.recompute_granularity == "none"  # no Megatron --recompute-* given
    assert cfg.memory.offload_modules == ("core_attn", "mlp")
    assert cfg.memory.tiled_mlp_tiles == 4 and cfg.memory.offload_prefetch is False
    assert LongContextConfig.from_flat(cfg.flat()) == cfg


@pytest.mark.parametrize("argv, flag", [
    (["--longctx-cp-ulysses-size", "2", "--longctx-cp-algorithm", "ring"], "--longctx-cp-ulysses-size"),
    (["--longctx-tiled-mlp-tiles", "-1"], "--longctx-tiled-mlp-tiles"),
    (["--longctx-offload-policy", "checkpoint"], "--longctx-offload-policy"),  # needs --recompute-granularity full
])
def test_bad_values_name_the_flag(argv, flag):
    args = add_longctx_args(argparse.ArgumentParser()).parse_args(argv)
    with pytest.raises(ValueError, match=flag):
        config_from_args(args)


def _literal_flags():
    return [(f.name, choices(cls)[f.name]) for f in _all_fields() for _, cls in FEATURES if f.name in choices(cls)]


def test_literal_fields_are_the_flags_with_choices():
    assert {name for name, _ in _literal_flags()} == {"cp_algorithm", "offload_policy", "offload_target",
                                                       "model_state_offload"}
    # the flag's choices are the attention's algorithms (one list) and "auto"
    assert dict(_literal_flags())["cp_algorithm"] == ("auto", *ALGORITHMS) == ("auto", "ring", "allgather", "ulysses",
                                                                               "hybrid")
    parser = add_longctx_args(argparse.ArgumentParser())
    for name, allowed in _literal_flags():
        assert parser._option_string_actions[flag_name(name)].choices == allowed


@pytest.mark.parametrize("name, allowed", _literal_flags())
def test_a_value_outside_the_choices_is_refused_naming_the_flag(name, allowed, capsys):
    parser = add_longctx_args(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args([flag_name(name), "zigzag"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {flag_name(name)}: invalid choice: 'zigzag'" in err, err
    assert all(value in err.rpartition("invalid choice")[2] for value in allowed), err
    # Programmatic use (apply_to_spec(**options), from_flat) gets the same check from __post_init__.
    with pytest.raises(ValueError, match=f"^{flag_name(name)}: got 'zigzag'; choose one of {', '.join(allowed)}$"):
        LongContextConfig.from_flat({name: "zigzag"})


def test_missing_flags_are_explained():
    with pytest.raises(ValueError, match="extra_args_provider"):
        config_from_args(argparse.Namespace())


def _megatron_arguments():
    try:
        from megatron.training import arguments
    except ImportError as exc:
        pytest.skip(f"this Megatron-Core wheel does not ship megatron.training ({exc}); 0.19 does")
    return arguments


def test_real_megatron_parser_no_clashes():
    arguments = _megatron_arguments()
    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    megatron_dests = {a.dest for a in parser._actions}
    add_longctx_args(parser)  # argparse raises on any clashing option string
    ours = {a.dest for a in parser._actions} - megatron_dests
    assert ours == {"longctx_" + f.name for f in _all_fields()}
    args = parser.parse_args([
        "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--seq-length", "64",
        "--recompute-granularity", "selective", "--longctx-cp-algorithm", "ring",
    ])
    assert args.context_parallel_size == 2 and args.cp_comm_type == ["a2a"] and args.seq_length == 64
    assert args.recompute_granularity == "selective"  # Megatron's own flag is untouched by ours
    cfg = config_from_args(args)
    assert cfg.cp.cp_algorithm == "ring"
    assert cfg.memory.recompute_granularity == "none"  # selective core_attn: Megatron runs its own
    with pytest.raises(SystemExit):
        parser.parse_args(["--longctx-recompute-granularity", "full"])  # Megatron's --recompute-* only


def test_real_parse_args_with_extra_args_provider(monkeypatch):
    arguments = _megatron_arguments()
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--num-layers", "2", "--longctx-cp-algorithm", "allgather"])
    args = arguments.parse_args(extra_args_provider=add_longctx_args)
    assert args.num_layers == 2 and config_from_args(args).cp.cp_algorithm == "allgather"


def _ns(**kw):
    """A parsed namespace: our defaults plus the given Megatron arguments."""
    args = add_longctx_args(argparse.ArgumentParser()).parse_args([])
    for key, value in kw.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("megatron, expected", [
    (dict(), dict(recompute_granularity="none")),
    # Megatron runs what it can: selective core_attn, full recompute.
    (dict(recompute_granularity="selective", recompute_modules=["core_attn"]), dict(recompute_granularity="none")),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     dict(recompute_granularity="none")),
    # Without TE Megatron's layernorm (and mlp with a bias) fail: the plugin runs the whole selective set.
    (dict(recompute_granularity="selective", recompute_modules=["layernorm", "core_attn"],
          transformer_impl="local"),
     dict(recompute_granularity="selective", recompute_modules=("layernorm", "core_attn"))),
    (dict(recompute_granularity="selective", recompute_modules=["mlp"], add_bias_linear=True, transformer_impl="local"),
     dict(recompute_granularity="selective", recompute_modules=("mlp",))),
    (dict(recompute_granularity="selective", recompute_modules=["mlp"], add_bias_linear=False, transformer_impl="local"),
     dict(recompute_granularity="none")),
    (dict(recompute_activations=True, recompute_modules=None, transformer_impl="local"),
     dict(recompute_granularity="none")),
    # Checkpoint offload owns the checkpoints: the plugin runs Megatron's full recompute.
    (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2,
          longctx_offload_policy="checkpoint"),
     dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)),
    # So does the replay in sequence tiles, which Megatron's recompute has no counterpart of.
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
          longctx_recompute_tiles=8),
     dict(recompute_granularity="full", recompute_method="uniform", recompute_tiles=8)),
])
def test_megatron_recompute_flags_fill_the_memory_config(megatron, expected):
    memory = config_from_args(_ns(**megatron)).memory
    for key, value in expected.items():
        assert getattr(memory, key) == value, key


def test_recompute_modules_the_plugin_cannot_run_are_named():
    args = _ns(recompute_granularity="selective", recompute_modules=["layernorm", "moe_act"], transformer_impl="local")
    with pytest.raises(ValueError, match="--recompute-modules: .*moe_act"):
        config_from_args(args)


TILED_FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                  longctx_recompute_tiles=4, hidden_dropout=0.0, attention_dropout=0.0)


@pytest.mark.parametrize("given, message", [
    (dict(context_parallel_size=2, cp_comm_type="p2p"), "--longctx-recompute-tiles: .*'p2p'.*--cp-comm-type all_gather"),
    (dict(context_parallel_size=2, cp_comm_type="all_gather", longctx_cp_algorithm="ring"),
     "--longctx-recompute-tiles: .*'ring'"),
    (dict(context_parallel_size=1, hidden_dropout=0.1), "--longctx-recompute-tiles: --hidden-dropout 0.1"),
    (dict(longctx_recompute_tiles=4, recompute_granularity=None), "--longctx-recompute-tiles: .*--recompute-granularity full"),
])
def test_recompute_tiles_refused_combinations_name_the_flag(given, message):
    with pytest.raises(ValueError, match=message):
        check_after_parsing(_ns(**{**TILED_FULL, **given}))


@pytest.mark.parametrize("given", [dict(context_parallel_size=2, cp_comm_type="all_gather"),
                                   dict(context_parallel_size=2, cp_comm_type="p2p", longctx_cp_algorithm="allgather"),
                                   dict(context_parallel_size=1, cp_comm_type="p2p")])
def test_recompute_tiles_accepted_with_all_gather_or_one_cp_rank(given):
    assert check_after_parsing(_ns(**{**TILED_FULL, **given})).memory.recompute_tiles == 4


@pytest.mark.parametrize("window, message", [
    ((-2, 0), "--window-size -2,0: each side is a number of tokens"),
    ((128, 4), "--window-size 128,4: the model's attention is causal.*--window-size 128,0"),
    ((1024, 0), "--window-size 1024,0: the left side covers the whole --seq-length 1024"),
])
def test_a_window_that_does_not_fit_is_refused_naming_the_flag(window, message):
    with pytest.raises(ValueError, match=message):
        check_after_parsing(_ns(window_size=window, seq_length=1024))
    assert check_after_parsing(_ns(window_size=(1023, 0), seq_length=1024)) is not None
