"""Each memory and time term of the planner against a hand-computed case (Llama-3-8B unless named).

Llama-3-8B per layer: attention 4096·128·(2·32 + 2·8) = 41,943,040, SwiGLU MLP 3·4096·14336 =
176,160,768, two RMSNorms 8,192: 218,112,000; one vocabulary matrix 128256·4096 = 525,336,576.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_longctx.plan import presets
from megatron_longctx.plan.flags import megatron_flags
from megatron_longctx.plan.memory import fa2_gqa_bytes, memory_breakdown
from megatron_longctx.plan.model import GIB, MemoryOptions, Parallel, param_counts
from megatron_longctx.plan.recommend import Constraints, PlanInfeasible, evaluate, recommend, tile_choices
from megatron_longctx.plan.timing import step_time

LLAMA8, H200 = presets.model("llama3-8b"), presets.gpu("h200")
LAYER, MATRIX = 218_112_000, 525_336_576
P = param_counts(LLAMA8).total
EFF = (0.35, 0.6)  # (attention, matmul)


def test_hand_counts():
    assert 32 * LAYER + 2 * MATRIX + 4096 == P


def test_pipeline_bubble_is_p_minus_1_over_m():
    s, opt = 32768, MemoryOptions(recompute="full")
    t = step_time(LLAMA8, s, Parallel(pp=4, micro_batches=8), opt, H200, eff=EFF)
    busy = t.matmul + t.attention + t.cp_exposed + t.tp_comm
    assert t.pp_bubble == pytest.approx(busy * 3 / 8)
    one = step_time(LLAMA8, s, Parallel(), opt, H200, eff=EFF)  # one micro-batch through all 32 layers
    assert busy == pytest.approx(8 / 4 * (one.matmul + one.attention))
    assert t.pp_comm > 0 and one.pp_bubble == one.pp_comm == 0


def test_pipeline_first_stage_holds_in_flight_micro_batches():
    s, opt = 32768, MemoryOptions(recompute="full", tiled_loss_tiles=32)
    mem = memory_breakdown(LLAMA8, s, Parallel(pp=4, micro_batches=8), opt)
    assert mem.stage == "first"
    assert mem.activations == 4 * 8 * s * 4096 * 2  # min(pp, m) = 4 micro-batches x 8 layer inputs
    assert mem.weights == 2 * (8 * LAYER + MATRIX) and mem.logits == 0
    two = memory_breakdown(LLAMA8, s, Parallel(pp=4, micro_batches=2), opt)
    assert two.activations == 2 * 8 * s * 4096 * 2
    # With one micro-batch the last stage (output layer, final norm, logits) is the larger.
    last = memory_breakdown(LLAMA8, s, Parallel(pp=4, micro_batches=1), opt)
    assert last.stage == "last" and last.logits == s * 128256 * (2 * 2 + 4) / 32
    assert last.weights == 2 * (8 * LAYER + MATRIX + 4096)


def test_global_batch_size_sets_the_micro_batches_and_flag():
    plan = recommend(LLAMA8, 131072, 8, H200, Constraints(global_batch_size=16, tp=2, cp=4))
    assert plan.parallel.dp == 1 and plan.parallel.micro_batches == 16 and plan.global_batch_size == 16
    flags = megatron_flags(plan)
    assert flags[flags.index("--global-batch-size") + 1] == "16"
    with pytest.raises(PlanInfeasible, match="--global-batch-size 3 must be a multiple"):
        recommend(LLAMA8, 131072, 8, H200, Constraints(global_batch_size=3, tp=2, cp=1))


def test_bf16_main_grads_halve_the_grad_buffer():
    opt = MemoryOptions(main_grads_dtype="bf16")
    mem = memory_breakdown(LLAMA8, 8192, Parallel(cp=2, dp=4), opt)
    assert mem.grads == 2 * P
    flags = megatron_flags(evaluate(LLAMA8, 8192, 8, H200, Parallel(cp=2, dp=4), opt))
    assert flags[flags.index("--main-grads-dtype") + 1] == "bf16" and "--use-precision-aware-optimizer" in flags


def test_megatron_fsdp_shards_weights_and_grads():
    par, opt = Parallel(dp=8), MemoryOptions(fsdp=True)
    mem = memory_breakdown(LLAMA8, 8192, par, opt)
    unit = max(LAYER, MATRIX)  # the largest block gathered at once: a vocabulary matrix
    assert mem.weights == pytest.approx(2 * P / 8 + 2 * 2 * unit)
    assert mem.grads == pytest.approx(4 * P / 8 + 4 * 2 * unit)
    assert mem.optimizer == pytest.approx(12 * P / 8)
    flags = megatron_flags(evaluate(LLAMA8, 8192, 8, H200, par, opt))
    assert "--use-megatron-fsdp" in flags and "--use-distributed-optimizer" not in flags


def test_fp8_gemms_cache_weights_and_run_at_the_fp8_peak():
    base, fp8 = MemoryOptions(), MemoryOptions(fp8=True)
    gemm = 32 * (LAYER - 8192)
    assert memory_breakdown(LLAMA8, 8192, Parallel(), fp8).weights == 2 * P + 2 * gemm
    t16 = step_time(LLAMA8, 8192, Parallel(), base, H200, eff=EFF)
    t8 = step_time(LLAMA8, 8192, Parallel(), fp8, H200, eff=EFF)
    assert t8.matmul == pytest.approx(t16.matmul * 989 / 1979) and t8.attention == t16.attention
    assert "--fp8-format" in megatron_flags(evaluate(LLAMA8, 8192, 1, H200, Parallel(), fp8))
    with pytest.raises(ValueError, match="--fp8"):
        step_time(LLAMA8, 8192, Parallel(), fp8, presets.gpu("a100"), eff=EFF)


def test_optimizer_offload_keeps_16_bytes_per_param_on_the_host():
    mem = memory_breakdown(LLAMA8, 8192, Parallel(cp=8), MemoryOptions(optimizer_offload=True))
    assert mem.optimizer == 0 and mem.host_offload == pytest.approx(16 * P / 8)


def test_sequence_parallel_all_gather_under_tp():
    s = 3_800_000  # a TP8·CP1 plan at 3.8M tokens: the gathered layer input alone is ~29 GiB
    mem = memory_breakdown(LLAMA8, s, Parallel(tp=8), MemoryOptions(recompute="full"))
    assert mem.sp_gather == s * 4096 * 2 and mem.sp_gather / GIB == pytest.approx(29.0, rel=0.005)
    assert memory_breakdown(LLAMA8, s, Parallel(tp=1), MemoryOptions(recompute="full")).sp_gather == 0


def test_flash_attention_2_expands_gqa_gradients():
    s = 1 << 20
    assert fa2_gqa_bytes(LLAMA8, s, Parallel(), MemoryOptions()) == s * 32 * 256 * 2 == 16 * GIB
    assert fa2_gqa_bytes(LLAMA8, s, Parallel(cp=8), MemoryOptions()) == 2 * GIB  # one ring block's keys
    assert fa2_gqa_bytes(LLAMA8, s, Parallel(cp=8, cp_comm_type="all_gather"), MemoryOptions()) == 16 * GIB
    assert fa2_gqa_bytes(LLAMA8, s, Parallel(), MemoryOptions(attention_backend="te_cudnn")) == 0
    assert fa2_gqa_bytes(presets.model("llama2-7b"), s, Parallel(), MemoryOptions()) == 0  # MHA


def test_dataloader_mask_is_counted_when_on():
    s = 131072
    on = memory_breakdown(LLAMA8, s, Parallel(cp=8), MemoryOptions(dataloader_mask=True))
    off = memory_breakdown(LLAMA8, s, Parallel(cp=8), MemoryOptions())
    assert on.dataloader_mask == s * s == 16 * GIB and off.dataloader_mask == 0
    assert on.host_offload - off.host_offload == 5 * s * s  # float32 tril + its bool copy while made
    assert on.peak - off.peak == 16 * GIB
    assert "--no-create-attention-mask-in-dataloader" in megatron_flags(
        evaluate(LLAMA8, s, 8, H200, Parallel(cp=8), MemoryOptions()))


def test_host_memory_is_per_node_and_shared_by_the_jobs_gpus():
    assert H200.host_bytes_per_gpu(1) == 2048 * GIB
    assert H200.host_bytes_per_gpu(8) == H200.host_bytes_per_gpu(64) == 256 * GIB
    one = evaluate(LLAMA8, 8192, 1, H200, Parallel(), MemoryOptions())
    assert one.host_usable_bytes == pytest.approx(0.9 * 2048 * GIB)


def test_tiles_follow_tokens_per_gpu():
    assert tile_choices(1 << 20, (8192, 2048)) == (1, 128, 512)
    assert tile_choices(4096, (8192, 2048)) == (1, 2)
    plan = recommend(LLAMA8, 1 << 20, 8, H200)
    tokens = plan.seq_length / plan.parallel.cp
    assert plan.options.tiled_loss_tiles > 1 and tokens / plan.options.tiled_loss_tiles <= 8192


def test_model_state_offload_keeps_two_blocks_on_the_gpu():
    opt = MemoryOptions(model_state_offload="host")
    mem = memory_breakdown(LLAMA8, 262144, Parallel(), opt)
    assert mem.weights == 2 * 2 * MATRIX and mem.grads == 2 * 4 * MATRIX and mem.optimizer == 0
    assert mem.host_offload == pytest.approx(18 * P)  # bf16 weights 2 + fp32 master 4 + moments 8 + grads 4
    # PCIe per layer is far below the layer's compute at 1M tokens: almost nothing exposed.
    t = step_time(LLAMA8, 1 << 20, Parallel(), dataclasses.replace(opt, recompute="full"), H200, eff=EFF)
    assert t.offload_exposed < 0.01 * t.total
    with pytest.raises(ValueError, match="drop --optimizer-offload"):
        MemoryOptions(model_state_offload="host", optimizer_offload=True)
    with pytest.raises(ValueError, match="choose one of host, disk"):
        MemoryOptions(model_state_offload="nvme")


def test_infeasible_answer_names_the_dominant_term_and_a_change():
    with pytest.raises(PlanInfeasible) as info:
        recommend(LLAMA8, 2 << 20, 1, H200)
    text = str(info.value)
    assert "the largest part is" in text and "Megatron keeps on the GPU" in text
    assert "Smallest change that fits: " in text and "--host-memory-gib-per-gpu" not in text
    with pytest.raises(PlanInfeasible, match="add --no-create-attention-mask-in-dataloader"):
        recommend(LLAMA8, 1 << 20, 8, H200, Constraints(dataloader_mask=True))
    small_host = dataclasses.replace(H200, host_memory_gib=100)  # 256K on one GPU needs ~200 GiB of host
    with pytest.raises(PlanInfeasible, match=r"more host memory: --host-memory-gib \d+ \(per node"):
        recommend(LLAMA8, 262144, 1, small_host)
