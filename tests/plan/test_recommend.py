"""The recommender: picks a plan that fits, refuses impossible requests clearly, emits flags that parse."""

from __future__ import annotations

import argparse
import json

import pytest

from megatron_longctx.plan import presets
from megatron_longctx.plan.cli import main as plan_main
from megatron_longctx.plan.flags import all_flags, longctx_options
from megatron_longctx.plan.model import GIB
from megatron_longctx.plan.recommend import Constraints, PlanInfeasible, all_plans, evaluate, recommend

LLAMA8 = presets.model("llama3-8b")
H200 = presets.gpu("h200")


def test_llama3_8b_1m_on_8_h200_fits():
    plan = recommend(LLAMA8, 1 << 20, 8, H200)
    assert plan.fits and plan.memory.peak <= 0.95 * H200.memory_gib * GIB
    par = plan.parallel
    assert par.tp * par.cp * par.dp == 8
    assert (1 << 20) % (2 * par.cp) == 0
    # A million tokens do not fit without recompute or offload: the plan must use one of them.
    assert plan.options.recompute == "full" or plan.options.offload != "none"
    # Re-scoring the chosen configuration gives the same numbers (the plan is self-consistent).
    again = evaluate(LLAMA8, 1 << 20, 8, H200, par, plan.options)
    assert again.memory.peak == plan.memory.peak and again.time.total == plan.time.total
    # It is the fastest fitting plan, up to the documented 3% tolerance.
    best = max(p.tokens_per_s_per_gpu for p in all_plans(LLAMA8, 1 << 20, 8, H200) if p.fits)
    assert plan.tokens_per_s_per_gpu >= 0.97 * best


def test_llama3_70b_1m_on_64_h200_fits():
    plan = recommend(presets.model("llama3-70b"), 1 << 20, 64, H200)
    assert plan.fits
    assert plan.parallel.tp * plan.parallel.cp * plan.parallel.dp == 64


def test_short_sequences_need_no_memory_features():
    plan = recommend(LLAMA8, 8192, 8, H200)
    assert plan.options.recompute == "none" and plan.options.offload == "none"


def test_impossible_request_is_refused_with_a_clear_message():
    with pytest.raises(PlanInfeasible, match=r"no configuration of llama3-70b .* fits 1 x h200") as info:
        recommend(presets.model("llama3-70b"), 1 << 22, 1, H200)
    message = str(info.value)
    assert "GiB per GPU" in message and "--num-gpus" in message and "--seq-length" in message
    assert isinstance(info.value, ValueError)


def test_fixed_choices_are_respected_or_refused():
    plan = recommend(LLAMA8, 1 << 20, 8, H200, Constraints(tp=2, cp=4, cp_comm_type="a2a+p2p"))
    assert (plan.parallel.tp, plan.parallel.cp, plan.parallel.cp_comm_type) == (2, 4, "a2a+p2p")
    assert plan.parallel.ulysses_size == 2
    with pytest.raises(PlanInfeasible, match="TP must divide the heads"):
        recommend(LLAMA8, 1 << 20, 8, H200, Constraints(tp=3))
    with pytest.raises(ValueError, match="--cp-comm-type"):
        Constraints(cp_comm_type="ring")
    with pytest.raises(ValueError, match="--recompute full"):
        Constraints(recompute="none", offload="checkpoint")
    plan = recommend(LLAMA8, 1 << 20, 8, H200, Constraints(recompute="full", tiled_loss_tiles=64))
    assert plan.options.recompute == "full" and plan.options.tiled_loss_tiles == 64


def _parser() -> argparse.ArgumentParser:
    from megatron_longctx.megatron.arguments import add_longctx_args

    parser = argparse.ArgumentParser(allow_abbrev=False)
    try:
        from megatron.training.arguments import add_megatron_arguments
    except ImportError:  # megatron-core < 0.19 ships no megatron.training: our flags and Megatron's recompute
        parser.add_argument("--recompute-granularity", default=None)
        parser.add_argument("--recompute-method", default=None)
        parser.add_argument("--recompute-num-layers", type=int, default=None)
        parser.add_argument("--recompute-modules", nargs="*", default=None)
        return add_longctx_args(parser), False
    return add_longctx_args(add_megatron_arguments(parser)), True


@pytest.mark.parametrize("name,gpus,seq,fixed", [
    ("llama3-8b", 8, 1 << 20, {}),
    ("llama3-70b", 64, 1 << 20, {}),
    ("llama3-8b", 16, 1 << 20, {"cp_comm_type": "a2a+p2p", "tp": 2, "cp": 8}),
    ("llama3-8b", 8, 1 << 19, {"offload": "checkpoint", "optimizer_offload": True}),
    ("mixtral-8x7b", 16, 262144, {}),
    ("deepseek-v2-lite", 8, 262144, {}),
    ("llama3-8b", 8, 131072, {"pp": 2, "global_batch_size": 8, "main_grads_dtype": "bf16", "fp8": True}),
    ("llama3-8b", 8, 131072, {"fsdp": True, "cp": 8}),
])
def test_emitted_flags_parse(name, gpus, seq, fixed):
    from megatron_longctx.megatron.arguments import config_from_args

    plan = recommend(presets.model(name), seq, gpus, H200, Constraints(**fixed))
    parser, with_megatron = _parser()
    flags = all_flags(plan)
    if with_megatron:
        args = parser.parse_args(flags)
        par = plan.parallel
        assert (args.tensor_model_parallel_size, args.context_parallel_size) == (par.tp, par.cp)
        assert args.seq_length == seq and args.num_layers == plan.model.num_layers
        if par.cp > 1:
            assert args.cp_comm_type == [par.cp_comm_type]
        if par.cp_comm_type == "a2a+p2p":
            assert args.hierarchical_context_parallel_sizes == [par.ulysses_size, par.cp // par.ulysses_size]
        # checkpoint offload is given as Megatron's full recompute; the plugin runs that recompute
        assert args.recompute_granularity == ("full" if plan.options.recompute == "full"
                                              or plan.options.offload == "checkpoint" else None)
        assert args.pipeline_model_parallel_size == par.pp and args.global_batch_size == plan.global_batch_size
        assert args.main_grads_dtype == plan.options.main_grads_dtype
        assert args.use_megatron_fsdp == plan.options.fsdp and (args.fp8 is not None) == plan.options.fp8
        assert args.create_attention_mask_in_dataloader is False
    else:
        args, _ = parser.parse_known_args(flags)
    cfg = config_from_args(args)
    for field, value in longctx_options(plan).items():
        assert cfg.flat()[field] == value


def test_cli_prints_plan_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_main(["--model", "llama3-8b", "--seq-length", "128K", "--num-gpus", "8", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recommended: TP" in text and "--context-parallel-size" in text and "peak" in text
    data = json.loads(out.read_text())
    assert data["seq_length"] == 131072
    assert data["memory_gib"]["peak"] <= 0.95 * H200.memory_gib


def test_cli_custom_shape_and_errors(capsys):
    rc = plan_main(["--model", "custom", "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "8",
                    "--kv-channels", "128", "--ffn-hidden-size", "4096", "--vocab-size", "32000",
                    "--seq-length", "65536", "--num-gpus", "2", "--gpu", "h100"])
    assert rc == 0 and "custom at 65,536 tokens on 2 x h100" in capsys.readouterr().out
    assert plan_main(["--model", "custom", "--seq-length", "1024", "--num-gpus", "1"]) == 2
    assert "--model custom needs --num-layers" in capsys.readouterr().err
    assert plan_main(["--model", "llama3-70b", "--seq-length", "4M", "--num-gpus", "1"]) == 2
    assert "no configuration of llama3-70b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_main(["--seq-length", "lots", "--num-gpus", "1"])


@pytest.mark.parametrize("name,tp,dp,ep", [("llama3-8b", 2, 4, 1), ("llama3-70b", 8, 8, 1), ("mixtral-8x7b", 2, 8, 8),
                                           ("deepseek-v2-lite", 1, 8, 8)])
def test_model_states_match_megatron_theoretical_memory(name, tp, dp, ep):
    # Megatron-LM's own estimator (megatron/training/theoretical_memory_usage.py), fed the flags the
    # planner emits: bf16 weights, fp32 grads, distributed optimizer 12 bytes/param over DP (CP = 1).
    theory = pytest.importorskip("megatron.training.theoretical_memory_usage",
                                 reason="megatron-core < 0.19 ships no megatron.training")
    from megatron_longctx.plan.model import MemoryOptions, Parallel
    from megatron_longctx.plan.recommend import evaluate

    m = presets.model(name)
    plan = evaluate(m, 4096, tp * dp, H200, Parallel(tp=tp, cp=1, dp=dp, ep=ep), MemoryOptions())
    parser, with_megatron = _parser()
    args, _ = parser.parse_known_args(all_flags(plan))
    args.padded_vocab_size, args.world_size, args.data_parallel_size = m.vocab_size, tp * dp, dp
    args.expert_tensor_parallel_size = tp
    args.kv_channels = args.kv_channels or args.hidden_size // args.num_attention_heads  # as validate_args sets it
    expected = theory.compute_weight_and_optimizer_memory(args)
    assert plan.memory.model_states == pytest.approx(expected, rel=0.005)
