"""Tiny Megatron GPTModels on the CPU, their batches, and their loss and gradients.

Two model kinds: the integration tests' float32 model without dropout (``build_gpt(tiny_config(tp, cp), spec)``,
``SEQ`` tokens, run inside a rank body under cpu_compat) and the memory tests' float64 oracle with dropout
(``build_gpt(**ORACLE)``, ``ORACLE_SEQ`` tokens).  Both: 2 layers, RoPE, GQA (4 query heads, 2 groups).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from megatron_longctx.megatron import cpu_compat

VOCAB, BATCH = 64, 2
SEQ = 16  # the integration tests' sequence
ORACLE_SEQ = 32  # the memory tests' sequence
# Every distributed test of tests/megatron runs on one pool of 4 gloo ranks (CP=2 cases as CP=2 x DP=2):
# spawning a pool costs far more on a small CI machine than the tiny models do.
WORLD = 4
# The memory tests' float64 model with dropout: ``build_gpt(**ORACLE, <config fields>)``.
ORACLE: dict[str, Any] = {"seq": ORACLE_SEQ, "dtype": torch.float64, "dropout": 0.1}


def tiny_config(tp: int = 1, cp: int = 1, mla: bool = False, *, dropout: float = 0.0,
                attention_dropout: float | None = None, dtype: torch.dtype = torch.float32, **overrides):
    """2 layers, RoPE, GQA (4 query heads, 2 groups), causal, CPU init; ``dropout`` for hidden and attention
    (``attention_dropout`` apart), parameters in ``dtype``; ``overrides``: any other config field."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    common = {
        "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "ffn_hidden_size": 64,
        "use_cpu_initialization": True, "hidden_dropout": dropout,
        "attention_dropout": dropout if attention_dropout is None else attention_dropout,
        "tensor_model_parallel_size": tp, "context_parallel_size": cp, "params_dtype": dtype,
    }
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


def build_gpt(config: Any = None, spec: Any = None, *, seed: int = 1234, seq: int = SEQ, **fields: Any):
    """A GPTModel of ``config`` (``None``: ``tiny_config(**fields)``) and ``spec`` (``None``: the local spec),
    ``seq`` positions, parameters drawn from ``seed`` and held in the config's ``params_dtype``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    config = tiny_config(**fields) if config is None else config
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(config, spec if spec is not None else local_spec(), vocab_size=VOCAB,
                         max_sequence_length=seq, position_embedding_type="rope")
    return model.to(config.params_dtype)


def batch(seed: int = 0, *, seq: int = SEQ, batch_size: int = BATCH) -> dict[str, torch.Tensor]:
    """``tokens``, ``labels``, ``loss_mask`` (about 80% ones) and ``position_ids``, all ``[batch_size, seq]``,
    drawn from ``seed`` (the tokens first: they do not depend on what follows them)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    labels = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    loss_mask = (torch.rand(batch_size, seq, generator=g) > 0.2).float()
    position_ids = torch.arange(seq).expand(batch_size, seq).contiguous()
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}


def cp_batches(cp_group: Any, seeds: range = range(2), seq: int = ORACLE_SEQ) -> list[dict[str, torch.Tensor]]:
    """This CP rank's share of ``batch(seed)`` for each seed: tokens and positions, Megatron's zigzag slicing."""
    from megatron_longctx.megatron.batch import get_batch_on_this_cp_rank

    out = []
    for seed in seeds:
        b = batch(seed=seed, seq=seq)
        out.append(get_batch_on_this_cp_rank({"tokens": b["tokens"], "position_ids": b["position_ids"]}, cp_group))
    return out


def loss_and_grads(model: torch.nn.Module, batches: dict | list | None = None, cp_group: Any = None,
                   total_tokens: Any = None, *, seed: int | None = 7, steps: int = 1,
                   around: Callable[[], Any] | None = None) -> tuple[torch.Tensor, dict]:
    """Forward + backward of each batch from zeroed grads; the losses summed, and the accumulated grads.

    ``batches``: one batch dict or a list of them; ``None``: ``batch(seed=step)`` for ``steps`` steps at the
    model's sequence length.  A batch with a ``loss_mask`` is scored as Megatron does (float32, masked sum /
    ``total_tokens``, default the mask's count) against its ``labels``; one without, as the mean over every
    position in float64 against its tokens shifted by one.  ``seed``: torch's and Megatron's RNGs seeded
    first (dropout); ``around``: a context manager factory entered around each forward; ``cp_group``: loss
    and grads summed over its ranks.
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if batches is None:
        batches = [batch(seed=step, seq=model.max_sequence_length) for step in range(steps)]
    elif isinstance(batches, dict):
        batches = [batches]
    if seed is not None:
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
    model.zero_grad(set_to_none=True)
    losses = []
    for b in batches:
        masked = b.get("loss_mask") is not None
        labels = b["labels"] if masked else torch.roll(b["tokens"], -1, dims=1)
        with around() if around is not None else contextlib.nullcontext():
            per_token = model(b["tokens"], b["position_ids"], None, labels=labels)  # [b, s_local]
        if masked:
            count = b["loss_mask"].sum() if total_tokens is None else total_tokens
            loss = (per_token.float() * b["loss_mask"]).sum() / count
        else:
            loss = per_token.double().mean()
        loss.backward()
        losses.append(loss.detach().clone())
    loss = sum(losses[1:], losses[0])
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        dist.all_reduce(loss, group=cp_group)
        for g in grads.values():
            dist.all_reduce(g, group=cp_group)
    return loss, grads


def assert_same(ref: tuple, got: tuple, rtol: float = 1e-9, atol: float = 1e-11) -> None:
    """Two ``(loss, grads)`` agree; every gradient but a bias's is nonzero."""
    (loss_ref, grads_ref), (loss_got, grads_got) = ref, got
    torch.testing.assert_close(loss_got, loss_ref, rtol=rtol, atol=atol)
    assert grads_ref.keys() == grads_got.keys() and grads_ref
    for name, g in grads_ref.items():
        assert g.abs().sum() > 0 or "bias" in name, f"{name} got no gradient"
        torch.testing.assert_close(grads_got[name], g, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def cpu() -> contextlib.AbstractContextManager:
    return cpu_compat.enabled()
