"""Model FLOPs of one sequence in the two conventions long-context numbers are published in.

* **Megatron** (``megatron.training.training.num_floating_point_operations``, megatron-core 0.19):
  every GEMM 3× (forward, dgrad, wgrad) × 2 (multiply-add) per token, the logits included, and core
  attention counted *causally*: ``6·s²·H`` per layer and sequence, ``H = hq·(d_qk + d_v)/2``.
  This is what ``plan`` reports TFLOP/s and MFU in, and what Megatron's ``--log-throughput`` prints.
* **NeMo** (its published long-sequence tables): the same GEMMs, attention counted *non-causally*:
  ``12·s²·H`` per layer.  At 1M tokens this nearly doubles the reported TFLOP/s.

Neither counts recompute, the norms or the softmax: they are *model* FLOPs, for MFU.
"""

from __future__ import annotations

from .model import ModelShape, param_counts

CONVENTIONS = ("megatron", "nemo")


def attention_hidden(m: ModelShape) -> float:
    """``H`` of the attention FLOP formulas: hq·(d_qk + d_v)/2 (= hq·d without MLA)."""
    return m.q_heads * (m.d_qk + m.d_v) / 2


def gemm_params_per_token(m: ModelShape) -> float:
    """Weights one token multiplies with: every layer's projections and (active) MLP, and the logits."""
    p = param_counts(m)
    dense = m.num_layers - m.num_moe_layers
    per_moe = p.moe_active - p.moe_router  # Megatron leaves the router GEMM out
    return m.num_layers * p.attention + dense * p.dense_mlp + m.num_moe_layers * per_moe + m.hidden_size * m.vocab_size


def model_flops(m: ModelShape, seq_length: int, batch: int = 1, convention: str = "megatron") -> float:
    """Model FLOPs of ``batch`` sequences of ``seq_length`` tokens, forward and backward."""
    if convention not in CONVENTIONS:
        raise ValueError(f"FLOP convention {convention!r}: choose one of {', '.join(CONVENTIONS)}")
    tokens = batch * seq_length
    core = (6.0 if convention == "megatron" else 12.0) * batch * float(seq_length) ** 2 * attention_hidden(m)
    return 6.0 * tokens * gemm_params_per_token(m) + m.num_layers * core
