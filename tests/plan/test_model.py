"""The planner's formulas against hand-computed numbers (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models")."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_longctx.plan import presets
from megatron_longctx.plan.flops import attention_hidden
from megatron_longctx.plan.memory import memory_breakdown
from megatron_longctx.plan.model import (
    GIB, MemoryOptions, ModelShape, Parallel, korthikanti_layer_bytes, layer_activations, param_counts,
)
from megatron_longctx.plan.timing import attention_flops, ring_bytes, ring_overlap_tokens, step_time, ulysses_bytes

# A GPT-3-style layer: MHA, GELU MLP of 4h, LayerNorm, no RoPE, dropout, 16-bit.
GPT3 = ModelShape(name="gpt3-like", num_layers=1, hidden_size=4096, num_attention_heads=32, num_query_groups=32,
                  kv_channels=128, ffn_hidden_size=4 * 4096, vocab_size=51200, activation="gelu",
                  normalization="LayerNorm", rope=False, untie_embeddings=False)


@pytest.mark.parametrize("name,total_b,active_b", [
    ("llama3-8b", 8.03, 8.03), ("llama3-70b", 70.55, 70.55), ("mixtral-8x7b", 46.70, 12.88),
    ("deepseek-v2-lite", 15.71, 2.66),
])
def test_presets_load_with_published_parameter_counts(name, total_b, active_b):
    counts = param_counts(presets.model(name))
    assert counts.total / 1e9 == pytest.approx(total_b, rel=0.01)
    assert counts.active / 1e9 == pytest.approx(active_b, rel=0.01)


def test_linear_biases_are_counted_per_output_and_refused_where_not_modelled():
    # Megatron's biases: QKV (q + 2 kv heads of kv_channels), projection (h), FC1 (GELU: ffn), FC2 (h) per layer.
    plain = dataclasses.replace(GPT3, num_layers=2)
    biased = dataclasses.replace(plain, add_bias_linear=True)
    per_layer = (32 + 2 * 32) * 128 + 4096 + 4 * 4096 + 4096
    assert param_counts(biased).total - param_counts(plain).total == 2 * per_layer
    swiglu = dataclasses.replace(biased, activation="swiglu")  # FC1 holds the gate and the up projection
    assert param_counts(swiglu).dense_mlp - param_counts(dataclasses.replace(swiglu, add_bias_linear=False)).dense_mlp \
        == 2 * 4 * 4096 + 4096
    with pytest.raises(ValueError, match="--disable-bias-linear"):
        dataclasses.replace(presets.model("mixtral-8x7b"), add_bias_linear=True)
    from megatron_longctx.plan.flags import model_flags

    assert "--disable-bias-linear" in model_flags(plain) and "--disable-bias-linear" not in model_flags(biased)


def test_preset_errors_name_the_flag():
    with pytest.raises(ValueError, match="--model"):
        presets.model("gpt-5")
    with pytest.raises(ValueError, match="--gpu"):
        presets.gpu("tpu")
    with pytest.raises(ValueError, match="--num-query-groups"):
        ModelShape(name="x", num_layers=1, hidden_size=64, num_attention_heads=6, num_query_groups=4, kv_channels=16,
                   ffn_hidden_size=64, vocab_size=8)


@pytest.mark.parametrize("s,b,tp", [(2048, 1, 1), (8192, 2, 1), (4096, 1, 8), (131072, 1, 4)])
def test_activation_bytes_match_korthikanti_34sbh(s, b, tp):
    # Flash attention, dropout on, sequence parallel: 34·s·b·h/t bytes (plus fp32 norm statistics and
    # the fp32 log-sum-exp, which the paper leaves out: 2·8 + 32·4 bytes per token here).
    opt = MemoryOptions(attention_impl="flash", hidden_dropout=0.1, attention_dropout=0.1)
    got = layer_activations(GPT3, s, Parallel(tp=tp, micro_batch=b), opt).total
    extra = s * b * (2 * 8 + 32 * 4) / tp
    assert got == pytest.approx(korthikanti_layer_bytes(s, b, 4096, 32, tp) + extra, rel=1e-9)
    assert got == pytest.approx(34 * s * b * 4096 / tp, rel=0.01)


def test_local_attention_adds_5as2b():
    s, b = 2048, 1
    opt = MemoryOptions(attention_impl="local", hidden_dropout=0.1, attention_dropout=0.1)
    flash = layer_activations(GPT3, s, Parallel(micro_batch=b), dataclasses.replace(opt, attention_impl="flash"))
    local = layer_activations(GPT3, s, Parallel(micro_batch=b), opt)
    assert local.scores == 5 * 32 * s * s * b  # softmax 2, dropout mask 1, dropped probs 2 (bytes)
    assert local.total - local.scores == pytest.approx(flash.total - s * b * 32 * 4)  # no lse on the local path


def test_context_parallel_divides_tokens():
    m = presets.model("llama3-8b")
    one = layer_activations(m, 65536, Parallel(), MemoryOptions()).total
    eight = layer_activations(m, 65536, Parallel(cp=8), MemoryOptions()).total
    assert eight == pytest.approx(one / 8)


def test_attention_flops_7bs2H():
    b, s, H = 2, 32768, 4096
    assert attention_flops(b, s, H, backward=False) == 2 * b * s * s * H
    assert attention_flops(b, s, H) == 7 * b * s * s * H
    assert attention_flops(b, s, H, recompute=True) == 9 * b * s * s * H
    assert attention_hidden(presets.model("llama3-8b")) == 4096


def test_ring_and_ulysses_bytes_match_anchor_formulas():
    # Llama-3-8B, 1M tokens, CP 8, bf16: (P-1)/P · 2·b·s·hkv·d·e.
    b, s, hkv, hq, d, p, e = 1, 1 << 20, 8, 32, 128, 8, 2
    assert ring_bytes(b, s, hkv, d, d, p, e) == 7 / 8 * 2 * b * s * hkv * d * e
    assert ring_bytes(b, s, hkv, d, d, p, e) == 3_758_096_384  # 3.5 GiB per layer forward
    assert ulysses_bytes(b, s, hq, hkv, d, p, e) == 7 / 64 * b * s * d * (2 * hq + 2 * hkv) * e


def test_ring_overlap_threshold_matches_anchor():
    # Published anchor: Llama-3-8B ≈ 1.1K tokens/GPU on NVLink, ≈ 10K on InfiniBand.
    m, hw = presets.model("llama3-8b"), presets.gpu("h100")
    assert ring_overlap_tokens(m, hw, inter_node=False) == pytest.approx(1.1e3, rel=0.05)
    assert ring_overlap_tokens(m, hw, inter_node=True) == pytest.approx(1.0e4, rel=0.05)


def test_ring_exposes_communication_only_below_the_threshold():
    m, hw = presets.model("llama3-8b"), presets.gpu("h100")
    opt, eff = MemoryOptions(), (0.5, 0.6)  # (attention, matmul) efficiency
    big = step_time(m, 8 * 65536, Parallel(cp=8), opt, hw, eff=eff)  # 64K tokens/GPU >> 1.1K
    small = step_time(m, 8 * 128, Parallel(cp=8), opt, hw, eff=eff)  # 128 tokens/GPU << 1.1K
    latency = 2 * 8 * hw.step_latency_s * m.num_layers
    assert big.cp_exposed == pytest.approx(latency)
    link = hw.intra_node_gbps * 1e9 * hw.link_efficiency
    comm = ring_bytes(1, 8 * 128, 8, 128, 128, 8, 2) / link  # K/V transfers of one layer's forward
    compute = attention_flops(1, 8 * 128, 4096, backward=False) / 8 / (hw.flops * eff[0])
    assert comm > 2.5 * compute  # below the threshold: the ring waits for its transfers
    exposed = (comm - compute) + (2 * comm - 2.5 * compute)
    assert small.cp_exposed == pytest.approx(latency + m.num_layers * exposed)


def test_distributed_optimizer_states():
    m = presets.model("llama3-8b")
    params = param_counts(m).total
    mem = memory_breakdown(m, 8192, Parallel(tp=1, cp=2, dp=4), MemoryOptions())
    assert mem.weights == pytest.approx(2 * params)
    assert mem.grads == pytest.approx(4 * params)
    assert mem.optimizer == pytest.approx(12 * params / 8)  # sharded over dp × cp


def test_full_recompute_keeps_layer_inputs_and_offload_moves_them():
    m = presets.model("llama3-8b")
    s, par = 1 << 20, Parallel(cp=8)
    plain = memory_breakdown(m, s, par, MemoryOptions())
    full = memory_breakdown(m, s, par, MemoryOptions(recompute="full"))
    off = memory_breakdown(m, s, par, MemoryOptions(recompute="full", offload="checkpoint"))
    layer_input = (s / 8) * 4096 * 2
    final = (s / 8) * 2 * 4096 * 2
    assert full.activations == pytest.approx(32 * layer_input + final)
    assert off.host_offload == pytest.approx(32 * layer_input)
    assert off.activations == pytest.approx(2 * layer_input + final)
    assert plain.activations > 10 * full.activations


def test_tiling_shrinks_the_working_set_and_logits():
    m = presets.model("llama3-8b")
    par = Parallel(cp=8)
    base = memory_breakdown(m, 1 << 20, par, MemoryOptions(recompute="full"))
    tiled = memory_breakdown(m, 1 << 20, par, MemoryOptions(recompute="full", tiled_mlp_tiles=4, tiled_loss_tiles=8))
    assert tiled.logits == pytest.approx(base.logits / 8)
    assert tiled.working < base.working
    assert base.logits == pytest.approx((1 << 20) / 8 * 128256 * 8)  # bf16 logits, their grad, fp32 softmax


def test_bad_options_raise():
    with pytest.raises(ValueError, match="recompute='full'"):
        MemoryOptions(offload="checkpoint")
    with pytest.raises(ValueError, match="context parallelism"):
        layer_activations(presets.model("llama3-8b"), 4096, Parallel(cp=2), MemoryOptions(attention_impl="local"))
    assert GIB == 1 << 30
