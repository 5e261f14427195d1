"""Full recompute replayed in sequence tiles (``--longctx-recompute-tiles``) in the planner: its memory and
time terms against hand counts, its refusals, its flags read back, the search and the CLI.

The small model: 2 layers, h = 64, 4 query heads / 2 KV groups of d = 16, SwiGLU ffn 128 (fused), RMSNorm,
RoPE (fused), bf16 (e = 2), no dropout.  Saved per token, by :func:`.model.layer_activations`' tensors:
both norms' inputs and outputs 2·(2·64·2) + 2·4 (fp32 rstd) = 520; the QKV buffer (4 + 2·2)·16 = 128, RoPE's
new q and k (4 + 2)·16 = 96, the output 4·16 = 64 elements = 576 bytes and the fp32 lse 4·4 = 16; FC1's
output 2·128 and the SwiGLU output 128 elements = 768 bytes; 1,880 bytes in all.  Plain full recompute's
working set is that layer again with the gradients of its MLP intermediates: 1,880 + 768 bytes per token.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex

import pytest

from megatron_longctx.plan import presets, recipes
from megatron_longctx.plan.cli import main as plan_main
from megatron_longctx.plan.flags import all_flags, longctx_flags, longctx_options, megatron_flags
from megatron_longctx.plan.memory import memory_breakdown
from megatron_longctx.plan.model import GIB, MemoryOptions, ModelShape, Parallel
from megatron_longctx.plan.recommend import Constraints, PlanInfeasible, all_plans, evaluate, recommend
from megatron_longctx.plan.timing import step_time

SMALL = ModelShape(name="small", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   kv_channels=16, ffn_hidden_size=128, vocab_size=256)
PER_TOKEN, MLP_PER_TOKEN = 1880, 768  # bytes one layer saves per token; the MLP's part of them
WORKING_PER_TOKEN = PER_TOKEN + MLP_PER_TOKEN  # plain full recompute's working set per token
S, E, H = 4096, 2, 64
KV_PER_TOKEN = 2 * (16 + 16)  # K and V elements per token: 2 groups x (d_qk + d_v)
LLAMA8, H200 = presets.model("llama3-8b"), presets.gpu("h200")
EFF = (0.35, 0.6)  # (attention, matmul)


def full(tiles: int = 1, **kw) -> MemoryOptions:
    return MemoryOptions(recompute="full", recompute_tiles=tiles, **kw)


def test_the_small_layer_saves_1880_bytes_per_token():
    plain = memory_breakdown(SMALL, S, Parallel(), full())
    assert plain.per_layer.total == PER_TOKEN * S and plain.per_layer.mlp == MLP_PER_TOKEN * S
    assert plain.working == WORKING_PER_TOKEN * S  # plain full recompute: one whole layer


def test_replay_working_set_is_the_layer_gradients_plus_one_tile():
    n = S  # tokens on the GPU (CP 1)
    mem = memory_breakdown(SMALL, S, Parallel(), full(4))
    assert mem.working == 2 * n * H * E + WORKING_PER_TOKEN * n / 4  # input + output gradient, a quarter tile
    # K/V of the whole sequence (bf16) and their fp32 gradient sums, one tile's fp32 dq + lse/delta; FA2's
    # GQA dK/dV expansion for one kernel call of at most 2,048 keys.
    kv_all = n * KV_PER_TOKEN
    dq = n / 4 * 4 * (16 * 4 + 4)
    fa2 = 2048 * 4 * (16 + 16) * E
    assert mem.attention_workspace == kv_all * (E + 4) + dq + fa2
    # The layer inputs stay on the GPU as under plain full recompute (+ the final norm's input and output).
    assert mem.activations == 2 * n * H * E + n * 2 * H * E
    # MLP tiles cut one replayed tile: its MLP part shrinks by their count too.
    mlp = memory_breakdown(SMALL, S, Parallel(), full(4, tiled_mlp_tiles=2))
    assert mlp.working == 2 * n * H * E + (PER_TOKEN - MLP_PER_TOKEN + MLP_PER_TOKEN / 2) * n / 4


def test_the_key_block_is_the_tile_attentions():
    from megatron_longctx.attention.tiled import KEY_BLOCK
    from megatron_longctx.plan.memory import REPLAY_KEY_BLOCK

    assert REPLAY_KEY_BLOCK == KEY_BLOCK


def test_replay_gathers_the_whole_sequence_under_cp():
    # CP 2, all-gather: half the tokens per GPU, but K/V (and dK/dV) of the whole sequence.
    n = S / 2
    mem = memory_breakdown(SMALL, S, Parallel(cp=2, cp_comm_type="all_gather"), full(4))
    assert mem.working == 2 * n * H * E + WORKING_PER_TOKEN * n / 4
    kv_all = 2 * n * KV_PER_TOKEN
    attend = kv_all * (E + 4) + n / 4 * 4 * (16 * 4 + 4)
    scatter = kv_all * 2 * 4  # the fp32 dK/dV and the reduce-scatter's send buffer, K/V freed
    assert scatter > attend
    assert mem.attention_workspace == scatter + 2048 * 4 * (16 + 16) * E


def test_offloaded_input_comes_back_one_tile_at_a_time():
    n = S
    layer_input = n * H * E
    plain = memory_breakdown(SMALL, S, Parallel(), full(1, offload="checkpoint"))
    tiled = memory_breakdown(SMALL, S, Parallel(), full(8, offload="checkpoint"))
    final = n * 2 * H * E
    assert plain.activations == 2 * layer_input + final  # one being written, one prefetched whole
    assert tiled.activations == layer_input + layer_input / 8 + final
    assert tiled.host_offload == plain.host_offload == 2 * layer_input  # every layer's input, as before


def test_replay_lowers_the_peak_of_a_long_sequence():
    s = 1 << 20
    job = dict(offload="checkpoint", optimizer_offload=True, tiled_loss_tiles=128)
    plain = memory_breakdown(LLAMA8, s, Parallel(), full(**job))
    tiled = memory_breakdown(LLAMA8, s, Parallel(), full(32, **job))
    assert tiled.working < plain.working / 4 and tiled.peak < plain.peak - 50 * GIB


def test_replay_time_adds_five_qkv_projections_and_its_passes():
    tiles = 8
    plain = step_time(SMALL, S, Parallel(), full(), H200, eff=EFF)
    tiled = step_time(SMALL, S, Parallel(), full(tiles), H200, eff=EFF)
    qkv_params = 64 * 16 * (4 + 2 * 2)  # the fused Q/K/V projection (no output projection)
    extra = 2 * 5 * 2 * S * qkv_params / (989e12 * 0.6) + 2 * 5 * tiles * 1e-4  # 2 layers
    assert tiled.matmul - plain.matmul == pytest.approx(extra, rel=1e-9)
    assert tiled.attention == plain.attention and tiled.cp_exposed == plain.cp_exposed == 0


def test_all_gather_transfers_plain_and_replayed():
    # Plain full recompute gathers K/V in forward, in its replay and in backward, and reduce-scatters
    # dK/dV: 4 transfers per layer; the tiled replay gathers in forward and once in backward: 3.
    par = Parallel(cp=2, cp_comm_type="all_gather")
    one = 1 / 2 * S * 2 * (16 + 16) * E / (450e9 * 0.8) + 20e-6  # (P-1)/P·s·hkv·(d_qk + d_v)·e, + latency
    none = step_time(SMALL, S, par, MemoryOptions(), H200, eff=EFF)
    plain = step_time(SMALL, S, par, full(), H200, eff=EFF)
    tiled = step_time(SMALL, S, par, full(4), H200, eff=EFF)
    assert none.cp_exposed == pytest.approx(2 * 3 * one, rel=1e-12)
    assert plain.cp_exposed == pytest.approx(2 * 4 * one, rel=1e-12)
    assert tiled.cp_exposed == pytest.approx(2 * 3 * one, rel=1e-12)


def test_replay_under_tp_without_sequence_parallelism():
    par = Parallel(tp=2)
    plain = step_time(SMALL, S, par, full(sequence_parallel=False), H200, eff=EFF)
    tiled = step_time(SMALL, S, par, full(4, sequence_parallel=False), H200, eff=EFF)
    unit = 1 / 2 * S * H * E / (450e9 * 0.8)  # one TP collective of the layer's hidden states
    assert tiled.tp_comm - plain.tp_comm == pytest.approx(2 * 2 * unit, rel=1e-9)  # 2 layers, one all-reduce
    mem = memory_breakdown(SMALL, S, par, full(4, sequence_parallel=False))
    # Without sequence parallelism the norms (520 bytes per token) are whole on each TP rank, the rest halves.
    per_token = 520 + (PER_TOKEN - 520) / 2 + MLP_PER_TOKEN / 2
    assert mem.sp_gather == 0 and mem.working == 2 * S * H * E + per_token * S / 4


@pytest.mark.parametrize("options,message", [
    (dict(recompute_tiles=4), "add --recompute full"),
    (dict(recompute="selective", recompute_tiles=4), "recompute='selective'"),
    (dict(recompute="full", recompute_tiles=0), "--recompute-tiles 0: give an integer >= 1"),
    (dict(recompute="full", recompute_tiles=4, hidden_dropout=0.1), "set --attention-dropout 0 and --hidden-dropout 0"),
    (dict(recompute="full", recompute_tiles=4, attention_impl="local"), "attention_impl='flash'"),
    (dict(recompute="full", recompute_tiles=4, attention_backend="te_cudnn"), "te_cudnn"),
])
def test_memory_options_refuse_what_the_replay_cannot_serve(options, message):
    with pytest.raises(ValueError, match=message) as info:
        MemoryOptions(**options)
    assert "--recompute-tiles" in str(info.value)


@pytest.mark.parametrize("model,par,opt,message", [
    (SMALL, Parallel(cp=2), full(4), "use --cp-comm-type all_gather"),
    (SMALL, Parallel(cp=2, cp_comm_type="a2a"), full(4), "'a2a'"),
    (SMALL, Parallel(tp=2), full(4), "drop --sequence-parallel"),
    (presets.model("mixtral-8x7b"), Parallel(), full(4), "--num-experts"),
])
def test_layouts_the_replay_refuses_name_the_flag(model, par, opt, message):
    for score in (lambda: memory_breakdown(model, S, par, opt), lambda: step_time(model, S, par, opt, H200, eff=EFF)):
        with pytest.raises(ValueError, match=message) as info:
            score()
        assert "--recompute-tiles 4" in str(info.value) and "set --recompute-tiles 1" in str(info.value)


@pytest.mark.parametrize("fixed,message", [
    (dict(recompute="none", recompute_tiles=4), "add --recompute full"),
    (dict(recompute_tiles=0), "--recompute-tiles 0"),
    (dict(cp=8, cp_comm_type="p2p", recompute_tiles=4), "add --cp-comm-type all_gather"),
    (dict(recompute_tiles=4, attention_backend="te_cudnn"), "te_cudnn"),
])
def test_constraints_refuse_a_replay_they_exclude(fixed, message):
    with pytest.raises(ValueError, match=message):
        Constraints(**fixed)


def _llama_plan(par: Parallel, opt: MemoryOptions, gpus: int = 8):
    return evaluate(LLAMA8, 1 << 20, gpus, H200, par, opt)


def test_flags_turn_the_replay_on_with_all_gather_cp():
    plan = _llama_plan(Parallel(cp=8, cp_comm_type="all_gather"), full(16, tiled_loss_tiles=16))
    options = longctx_options(plan)
    assert options["recompute_tiles"] == 16 and options["recompute_granularity"] == "full"
    assert options["cp_algorithm"] == "allgather"
    argv = longctx_flags(plan)
    assert argv[argv.index("--longctx-recompute-tiles") + 1] == "16"
    assert argv[argv.index("--longctx-cp-algorithm") + 1] == "allgather"
    megatron = megatron_flags(plan)
    assert megatron[megatron.index("--recompute-granularity") + 1] == "full"
    assert megatron[megatron.index("--cp-comm-type") + 1] == "all_gather"
    untiled = longctx_flags(_llama_plan(Parallel(cp=8, cp_comm_type="all_gather"), full(1, tiled_loss_tiles=16)))
    assert "--longctx-recompute-tiles" not in untiled


def test_flags_leave_sequence_parallelism_off_when_the_plan_does():
    plan = _llama_plan(Parallel(tp=2, cp=4, cp_comm_type="all_gather"),
                       full(16, sequence_parallel=False, tiled_loss_tiles=16))
    assert "--sequence-parallel" not in megatron_flags(plan)
    sp = _llama_plan(Parallel(tp=2, cp=4, cp_comm_type="all_gather"), full(tiled_loss_tiles=16))
    assert "--sequence-parallel" in megatron_flags(sp)


def _parser() -> tuple[argparse.ArgumentParser, bool]:
    from megatron_longctx.megatron.arguments import add_longctx_args

    parser = argparse.ArgumentParser(allow_abbrev=False)
    try:
        from megatron.training.arguments import add_megatron_arguments
    except ImportError:  # megatron-core < 0.19 ships no megatron.training: our flags and the ones read here
        for flag in ("--recompute-granularity", "--recompute-method", "--cp-comm-type"):
            parser.add_argument(flag, default=None)
        parser.add_argument("--recompute-num-layers", type=int, default=None)
        parser.add_argument("--context-parallel-size", type=int, default=1)
        return add_longctx_args(parser), False
    return add_longctx_args(add_megatron_arguments(parser)), True


@pytest.mark.parametrize("par,opt", [
    (Parallel(cp=8, cp_comm_type="all_gather"), full(16, tiled_loss_tiles=16)),
    (Parallel(cp=8, cp_comm_type="all_gather"), full(64, offload="checkpoint", tiled_loss_tiles=16)),
    (Parallel(tp=2, cp=4, cp_comm_type="all_gather"), full(16, sequence_parallel=False, tiled_loss_tiles=16)),
    (Parallel(cp=8, cp_comm_type="all_gather"), full(16, offload="layers", tiled_loss_tiles=16)),
])
def test_emitted_flags_parse_and_pass_the_plugins_checks(par, opt):
    from megatron_longctx.megatron.arguments import check_after_parsing

    plan = _llama_plan(par, opt)
    parser, with_megatron = _parser()
    flags = all_flags(plan)
    args = parser.parse_args(flags) if with_megatron else parser.parse_known_args(flags)[0]
    cfg = check_after_parsing(args)  # the plugin's refusals (all-gather CP, dropout) pass
    assert cfg.memory.recompute_tiles == opt.recompute_tiles and cfg.memory.recompute_granularity == "full"
    assert cfg.cp.cp_algorithm == "allgather" and cfg.memory.offload_policy == opt.offload
    if with_megatron:
        assert args.sequence_parallel == (par.tp > 1 and opt.sequence_parallel)


@pytest.mark.parametrize("par,opt", [
    (Parallel(cp=8, cp_comm_type="all_gather"), full(16, tiled_loss_tiles=16)),
    (Parallel(tp=2, cp=4, cp_comm_type="all_gather"), full(16, sequence_parallel=False, tiled_loss_tiles=16)),
    (Parallel(cp=8, cp_comm_type="all_gather"), full(1, tiled_loss_tiles=16)),
])
def test_recipes_read_the_replay_back_from_the_flags(par, opt):
    plan = _llama_plan(par, opt)
    text = "torchrun --nproc-per-node 8 $MEGATRON_LM/pretrain_gpt.py " + shlex.join(all_flags(plan)) + "\n"
    back = recipes.recipe_plan(text)
    for name in ("recompute", "offload", "recompute_tiles", "tiled_loss_tiles", "sequence_parallel"):
        assert getattr(back.options, name) == getattr(opt, name), name
    assert back.parallel == plan.parallel and back.memory.peak == plan.memory.peak
    zero = text.replace("--longctx-recompute-tiles 16", "--longctx-recompute-tiles 0")
    assert recipes.recipe_plan(zero).options.recompute_tiles == 1


def test_search_replays_in_tiles_where_that_makes_a_sequence_fit():
    # Llama-3-8B at 1M tokens on one H200: plain full recompute holds one layer's activations for the
    # whole sequence (> 100 GiB); replayed in tiles the step fits.
    plan = recommend(LLAMA8, 1 << 20, 1, H200)
    assert plan.options.recompute == "full" and plan.options.recompute_tiles > 1
    assert (1 << 20) / plan.options.recompute_tiles <= 32768  # tile counts follow the tokens per tile
    with pytest.raises(PlanInfeasible):
        recommend(LLAMA8, 1 << 20, 1, H200, Constraints(recompute_tiles=1))
    untiled = memory_breakdown(LLAMA8, 1 << 20, plan.parallel, dataclasses.replace(plan.options, recompute_tiles=1))
    assert plan.memory.peak < untiled.peak


def test_search_tries_the_replay_only_where_the_plugin_runs_it():
    plans = all_plans(LLAMA8, 1 << 20, 8, H200)
    tiled = [p for p in plans if p.options.recompute_tiles > 1]
    assert tiled and all(p.options.recompute == "full" and p.parallel.tp == 1 for p in tiled)
    assert all(p.parallel.cp == 1 or p.parallel.cp_comm_type == "all_gather" for p in tiled)
    assert {p.parallel.cp for p in tiled} > {1}
    # It costs time: a short sequence that fits without it does not use it.
    assert recommend(LLAMA8, 8192, 8, H200).options.recompute_tiles == 1
    assert not [p for p in all_plans(presets.model("mixtral-8x7b"), 65536, 16, H200) if p.options.recompute_tiles > 1]
    fixed = recommend(LLAMA8, 1 << 20, 8, H200, Constraints(recompute_tiles=32, cp=8))
    assert fixed.options.recompute_tiles == 32 and fixed.parallel.cp_comm_type == "all_gather"
    with pytest.raises(PlanInfeasible, match="--recompute-tiles needs TP 1"):
        recommend(LLAMA8, 1 << 20, 8, H200, Constraints(recompute_tiles=32, tp=2))


def test_cli_fixes_the_replay_tiles(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert plan_main(["--model", "llama3-8b", "--seq-length", "1M", "--num-gpus", "8", "--cp", "8",
                      "--recompute-tiles", "32", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recompute tiles 32" in text and "--longctx-recompute-tiles 32" in text
    assert "--longctx-cp-algorithm allgather" in text and "--cp-comm-type all_gather" in text
    assert '"recompute_tiles": 32' in out.read_text()
    assert plan_main(["--model", "llama3-8b", "--seq-length", "1M", "--num-gpus", "8", "--recompute", "none",
                      "--recompute-tiles", "4"]) == 2
    assert "--recompute-tiles 4 replays the layers of full recompute" in capsys.readouterr().err
