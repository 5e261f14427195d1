"""Tiny Megatron GPT models for the integration tests (run inside a rank body, under cpu_compat)."""

from __future__ import annotations

import warnings

import torch

SEQ, BATCH, VOCAB = 16, 2, 64
# Every distributed test of this folder runs on one pool of 4 gloo ranks (CP=2 cases as CP=2 x DP=2):
# spawning a pool costs far more on a small CI machine than the tiny models do.
WORLD = 4


def tiny_config(tp: int = 1, cp: int = 1, mla: bool = False, **overrides):
    """2 layers, RoPE, GQA (4 query heads, 2 groups), causal, no dropout, CPU init."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    common = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, context_parallel_size=cp,
    )
    common.update(overrides)
    if mla:
        return MLATransformerConfig(
            q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
            rope_type="rope", normalization="RMSNorm", **common,
        )
    common.setdefault("num_query_groups", 2)
    return TransformerConfig(**common)


def local_spec(mla: bool = False):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(multi_latent_attention=mla) if mla else get_gpt_layer_local_spec()


def build_gpt(config, spec, seed: int = 1234):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")


def global_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    loss_mask = (torch.rand(BATCH, SEQ, generator=g) > 0.2).float()
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    return dict(tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids)


def loss_and_grads(model, batch, cp_group=None, total_tokens=None):
    """Megatron's loss (masked sum / token count) summed over CP ranks, and the grads summed over CP ranks."""
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [b, s_local]
    count = batch["loss_mask"].sum() if total_tokens is None else total_tokens
    loss = (per_token.float() * batch["loss_mask"]).sum() / count
    loss.backward()
    loss = loss.detach().clone()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        dist.all_reduce(loss, group=cp_group)
        for g in grads.values():
            dist.all_reduce(g, group=cp_group)
    return loss, grads
