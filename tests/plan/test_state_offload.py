"""The planner's model-state offload, counted against the model it models: the streamed layer's and the
whole model's parameters against a GPTModel Megatron builds, the bytes per layer and step and the host /
NVMe bytes from those counts, the copy times from the links, what hides behind the layer's compute, the
flags, and the longest sequence on one GPU against today's features."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_longctx.plan import presets
from megatron_longctx.plan.advice import longest_sequence
from megatron_longctx.plan.flags import HOST_POOL_MARGIN, longctx_flags, megatron_flags
from megatron_longctx.plan.memory import memory_breakdown
from megatron_longctx.plan.model import GIB, MemoryOptions, ModelShape, Parallel
from megatron_longctx.plan.recommend import Constraints, evaluate
from megatron_longctx.plan.state_offload import HOST_ADAM_PARAMS_PER_S, disk_step_bytes_per_param, state_offload
from megatron_longctx.plan.timing import OFFLOAD_CONTENTION, step_time
from tests.dist import megatron_parallel, run_ranks

LLAMA8, H100, H200 = presets.model("llama3-8b"), presets.gpu("h100"), presets.gpu("h200")
EFF = (0.35, 0.6)
# A Llama-shaped model small enough to build: GQA, SwiGLU, RMSNorm, no biases, untied output layer.
TINY = ModelShape(name="tiny", num_layers=3, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                  kv_channels=16, ffn_hidden_size=160, vocab_size=1000)


def _built_counts(shape: ModelShape) -> dict:
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_longctx.megatron import cpu_compat

    with cpu_compat.enabled(), megatron_parallel():
        config = TransformerConfig(num_layers=shape.num_layers, hidden_size=shape.hidden_size,
                                   num_attention_heads=shape.num_attention_heads,
                                   num_query_groups=shape.num_query_groups, kv_channels=shape.kv_channels,
                                   ffn_hidden_size=shape.ffn_hidden_size, gated_linear_unit=True,
                                   activation_func=torch.nn.functional.silu, normalization="RMSNorm",
                                   add_bias_linear=False, use_cpu_initialization=True)
        model = GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=shape.vocab_size,
                         max_sequence_length=64, position_embedding_type="rope",
                         share_embeddings_and_output_weights=False)
        return {"layer": sum(p.numel() for p in model.decoder.layers[0].parameters()),
                "total": sum(p.numel() for p in model.parameters()),
                "largest": max(p.numel() for p in model.parameters())}


def test_streamed_bytes_are_the_built_models_parameters():
    built = run_ranks(1, _built_counts, TINY)[0]
    for target in ("host", "disk"):
        so = state_offload(TINY, Parallel(), MemoryOptions(model_state_offload=target))
        assert so.layer_params == built["layer"] and so.total_params == built["total"]
        assert so.largest_unit == built["largest"]  # the output layer's vocabulary matrix
        assert so.weights_in == 2 * built["layer"] and so.grads_out == 4 * built["layer"]
        p = built["total"]
        if target == "host":  # bf16 weights + fp32 master + Adam moments + fp32 main grads
            assert so.host == (2 + 4 + 8 + 4) * p and so.disk == 0
        else:  # on the host the pinned buffers one unit passes through: staging (its fp32 grads), read-ahead
            # (bf16 weights), masters; weights, masters, grads and moments on NVMe
            assert so.host == (4 + 2 + 4) * built["largest"]
            assert so.disk == (2 + 4 + 4 + 8 + 8) * p  # the step writes the new moments beside the old ones
    bf16_grads = state_offload(TINY, Parallel(), MemoryOptions(model_state_offload="host", main_grads_dtype="bf16"))
    assert bf16_grads.grads_out == 2 * built["layer"] and bf16_grads.host == (2 + 4 + 8 + 2) * built["total"]


def test_llama3_8b_layer_from_its_shape():
    m, so = LLAMA8, state_offload(LLAMA8, Parallel(), MemoryOptions(model_state_offload="host"))
    h, d = m.hidden_size, m.kv_channels
    layer = h * d * (2 * m.num_attention_heads + 2 * m.num_query_groups) + 3 * h * m.ffn_hidden_size + 2 * h
    total = m.num_layers * layer + 2 * m.vocab_size * h + h
    assert so.layer_params == layer and so.total_params == total
    tp2 = state_offload(LLAMA8, Parallel(tp=2), MemoryOptions(model_state_offload="host"))
    assert tp2.layer_params == (layer - 2 * h) / 2 + 2 * h  # TP shards the GEMMs, replicates the norms


@pytest.mark.parametrize("target", ["host", "disk"])
def test_copy_times_and_what_hides_behind_the_layer(target):
    opt = MemoryOptions(model_state_offload=target, recompute="full")
    so = state_offload(LLAMA8, Parallel(), opt)
    pcie = H200.host_gbps * 1e9 * H200.link_efficiency
    weights_in = pcie if target == "host" else min(pcie, H200.nvme_gbps * 1e9)
    for s in (2048, 1 << 20):
        t = step_time(LLAMA8, s, Parallel(), opt, H200, eff=EFF)
        layer = so.layer_copies(H200, t.layer_forward_s, replay=True)
        assert layer.weights_in_s == 2 * so.layer_params / weights_in
        assert layer.grads_out_s == 4 * so.layer_params / weights_in  # to NVMe for disk
        assert layer.backward_s == 3 * t.layer_forward_s  # recompute + backward
        exposed = (max(0.0, layer.weights_in_s - layer.forward_s)
                   + max(0.0, max(layer.weights_in_s, layer.grads_out_s) - layer.backward_s))
        assert layer.exposed_s == exposed
        opt_s = so.total_params / HOST_ADAM_PARAMS_PER_S  # the CPU AdamW, once a step
        if target == "disk":  # grads read twice, moments read, written and read back, masters read and
            # written, weights written: through NVMe
            opt_s += (2 * 4 + 3 * 8 + 2 * 4 + 2) * so.total_params / (H200.nvme_gbps * 1e9)
        assert so.optimizer_step_s(H200) == opt_s and disk_step_bytes_per_param(4) == 42
        # The step's exposed offload time is the layers' exposed copies + a contention share of all of them +
        # the embedding's and output layer's copies + the optimizer step (no activation offload here).
        other = (2 * 2 * so.other_params + 4 * so.other_params) / weights_in
        want = LLAMA8.num_layers * (exposed + OFFLOAD_CONTENTION * layer.copy_s) + other + opt_s
        assert t.offload_exposed == pytest.approx(want, rel=1e-12)
        assert layer.hidden == (s == 1 << 20)  # short sequences leave the copies exposed, 1M hides them


def test_host_memory_is_shared_with_the_activation_offload_and_the_flags_say_so():
    s = 1 << 20
    plan = evaluate(LLAMA8, s, 1, H200, Parallel(), MemoryOptions(model_state_offload="host", recompute="full",
                                                                  offload="checkpoint", recompute_tiles=32,
                                                                  tiled_loss_tiles=128))
    so = state_offload(LLAMA8, Parallel(), plan.options)
    assert plan.memory.host_offload == pytest.approx(so.host + plan.memory.activation_host)
    flags = longctx_flags(plan)
    assert flags[flags.index("--longctx-model-state-offload") + 1] == "host"
    pool = int(flags[flags.index("--longctx-offload-host-pool-bytes") + 1])
    assert pool == math.ceil((plan.memory.activation_host + so.pinned) * HOST_POOL_MARGIN / GIB) * GIB
    assert "--optimizer-cpu-offload" not in megatron_flags(plan)  # its own AdamW replaces Megatron's hybrid one


@pytest.mark.parametrize("gpu,at_least", [(H200, 2_400_000), (H100, 1_200_000)])
def test_one_gpu_trains_a_longer_llama3_8b_with_it(gpu, at_least):
    today = longest_sequence(LLAMA8, 1, gpu, Constraints(), 1, None)
    streamed = longest_sequence(LLAMA8, 1, gpu, Constraints(model_state_offload="host"), 1, None)
    assert streamed.options.model_state_offload == "host" and not streamed.options.optimizer_offload
    # What it removes from the GPU is what lets the sequence grow: bf16 weights + fp32 main grads.
    assert streamed.memory.weights + streamed.memory.grads < 0.2 * (today.memory.weights + today.memory.grads)
    assert streamed.seq_length > 1.4 * today.seq_length and streamed.seq_length >= at_least


def test_bad_targets_are_refused_with_the_flag():
    with pytest.raises(ValueError, match="--model-state-offload 'nvme': choose one of host, disk"):
        Constraints(model_state_offload="nvme")
    with pytest.raises(ValueError, match="drop --optimizer-offload"):
        Constraints(model_state_offload="disk", optimizer_offload=True)
    with pytest.raises(ValueError, match="--megatron-fsdp"):
        Constraints(model_state_offload="host", fsdp=True)
    assert dataclasses.replace(Constraints(), model_state_offload="disk").model_state_offload == "disk"


def _sharded_plan():
    opt = MemoryOptions(model_state_offload="host", recompute="full", offload="checkpoint", recompute_tiles=32,
                        tiled_loss_tiles=128)
    par = Parallel(cp=2, dp=4, cp_comm_type="all_gather")
    return evaluate(LLAMA8, 1 << 20, 8, H200, par, opt), par, opt


def test_a_sharded_plan_holds_each_ranks_share_of_adam_on_the_host_and_prints_the_distributed_optimizer():
    """At DP x CP > 1 the plan prints Megatron's --use-distributed-optimizer beside the offload (not Megatron's
    overlapped reduction, which the streamer does per layer) and counts each rank's share of the moments."""
    plan, par, opt = _sharded_plan()
    argv = [str(a) for a in megatron_flags(plan)]
    assert "--use-distributed-optimizer" in argv and "--no-gradient-accumulation-fusion" in argv
    assert "--overlap-grad-reduce" not in argv and "--overlap-param-gather" not in argv
    sharded, whole = state_offload(LLAMA8, par, opt), state_offload(LLAMA8, Parallel(), opt)
    assert sharded.optimizer_shards == 8 and whole.optimizer_shards == 1
    assert sharded.host_parts()["Adam moments"] == pytest.approx(whole.host_parts()["Adam moments"] / 8)
    assert sharded.host_parts()["fp32 master weights"] == whole.host_parts()["fp32 master weights"]  # whole


def test_the_printed_flags_of_a_sharded_plan_pass_the_launchers_checks():
    """The printed command line through the launcher's checks before start: accepted, and the plugin takes the
    distributed optimizer over; Megatron's overlapped reduction beside it is refused by name."""
    pytest.importorskip("megatron.training.arguments", reason="megatron-core < 0.19 ships no megatron.training")
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron_longctx.job.command_line import check_flags
    from megatron_longctx.megatron.arguments import add_longctx_args, check_after_parsing

    plan, _, _ = _sharded_plan()
    argv = [str(a) for a in megatron_flags(plan) + longctx_flags(plan)]
    check_flags(argv)
    args, _ = add_longctx_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))).parse_known_args(argv)
    cfg = check_after_parsing(args)
    assert cfg.model_states.distributed_optimizer and not args.use_distributed_optimizer  # the plugin runs it
    with pytest.raises(ValueError, match="--longctx-model-state-offload: .*drop --overlap-grad-reduce"):
        check_flags([*argv, "--overlap-grad-reduce"])
