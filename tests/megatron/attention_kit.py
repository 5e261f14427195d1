"""ContextParallelAttention as Megatron builds it, its float64 inputs, and Megatron's zigzag CP shard."""

import torch

S, B, HQ, HKV, D = 16, 2, 4, 2, 8


def attention_config(**overrides):
    """A TransformerConfig of ``HQ`` query heads, ``HKV`` groups, head dim ``D``, no dropout, CPU init."""
    from megatron.core.transformer import TransformerConfig

    base = {"num_layers": 2, "hidden_size": HQ * D, "num_attention_heads": HQ, "num_query_groups": HKV,
            "kv_channels": D, "attention_dropout": 0.0, "hidden_dropout": 0.0, "use_cpu_initialization": True}
    base.update(overrides)
    return TransformerConfig(**base)


def cp_attention(config=None, mask_type=None, **kwargs):
    """ContextParallelAttention of layer 1 (self-attention, causal unless ``mask_type``)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_longctx import ContextParallelAttention

    kwargs.setdefault("attention_type", "self")
    return ContextParallelAttention(config=config or attention_config(), layer_number=1,
                                    attn_mask_type=mask_type or AttnMaskType.causal, **kwargs)


def qkv_inputs(seed=0, dv=D, hq=HQ, hkv=HKV, dtype=torch.float64):
    """q ``[S, B, hq, D]``, k ``[S, B, hkv, D]``, v ``[S, B, hkv, dv]`` and dout ``[S, B, hq*dv]`` from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, hq, D, generator=g, dtype=dtype)
    k = torch.randn(S, B, hkv, D, generator=g, dtype=dtype)
    v = torch.randn(S, B, hkv, dv, generator=g, dtype=dtype)
    dout = torch.randn(S, B, hq * dv, generator=g, dtype=dtype)
    return q, k, v, dout


def zigzag(x, rank, cp):
    """CP rank ``rank``'s shard of ``x`` (sequence first): chunks ``rank`` and ``2cp-1-rank`` of ``2cp``."""
    chunks = x.chunk(2 * cp, dim=0)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=0)
