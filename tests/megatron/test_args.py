"""The --longctx-* flags: generated from the config dataclasses, parsed back, alongside Megatron's parser."""

import argparse
import dataclasses

import pytest

from megatron_longctx import add_longctx_args, config_from_args
from megatron_longctx.config import FEATURES, ContextParallelConfig, LongContextConfig, flag_name


def _all_fields():
    return [f for _, cls in FEATURES for f in dataclasses.fields(cls)]


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
        "--longctx-recompute-granularity", "selective", "--longctx-recompute-modules", "core_attn", "mlp",
        "--longctx-tiled-mlp-tiles", "4", "--no-longctx-offload-prefetch", "--longctx-offload-modules", "core_attn,mlp",
    ])
    cfg = config_from_args(args)
    assert cfg.cp == ContextParallelConfig(cp_algorithm="ulysses", cp_kernel_backend="reference")
    assert cfg.memory.recompute_granularity == "selective"
    assert cfg.memory.recompute_modules == ("core_attn", "mlp")
    assert cfg.memory.offload_modules == ("core_attn", "mlp")
    assert cfg.memory.tiled_mlp_tiles == 4 and cfg.memory.offload_prefetch is False
    assert LongContextConfig.from_flat(cfg.flat()) == cfg


@pytest.mark.parametrize("argv, flag", [
    (["--longctx-cp-algorithm", "zigzag"], "--longctx-cp-algorithm"),
    (["--longctx-cp-ulysses-size", "2", "--longctx-cp-algorithm", "ring"], "--longctx-cp-ulysses-size"),
    (["--longctx-tiled-mlp-tiles", "-1"], "--longctx-tiled-mlp-tiles"),
    (["--longctx-recompute-modules", "attention"], "--longctx-recompute-modules"),
])
def test_bad_values_name_the_flag(argv, flag):
    args = add_longctx_args(argparse.ArgumentParser()).parse_args(argv)
    with pytest.raises(ValueError, match=flag):
        config_from_args(args)


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
        "--longctx-recompute-granularity", "full",
    ])
    assert args.context_parallel_size == 2 and args.cp_comm_type == ["a2a"] and args.seq_length == 64
    assert args.recompute_granularity == "selective"  # Megatron's own flag is untouched by ours
    cfg = config_from_args(args)
    assert cfg.cp.cp_algorithm == "ring" and cfg.memory.recompute_granularity == "full"


def test_real_parse_args_with_extra_args_provider(monkeypatch):
    arguments = _megatron_arguments()
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--num-layers", "2", "--longctx-cp-algorithm", "allgather"])
    args = arguments.parse_args(extra_args_provider=add_longctx_args)
    assert args.num_layers == 2 and config_from_args(args).cp.cp_algorithm == "allgather"
