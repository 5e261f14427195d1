"""A tiny Megatron GPTModel on the CPU and its loss + gradients: the oracle for the memory tests."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from megatron_longctx import cpu_compat

VOCAB, SEQ, BATCH = 64, 32, 2


def build_gpt(*, seed: int = 1234, spec: Any = None, num_layers: int = 2, dropout: float = 0.1,
              attention_dropout: Optional[float] = None, add_bias_linear: bool = True,
              dtype: torch.dtype = torch.float64, **config: Any):
    """A 2-layer GPTModel (local spec, RoPE), parameters drawn from ``seed`` (same for every variant)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=num_layers, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        use_cpu_initialization=True, hidden_dropout=dropout,
        attention_dropout=dropout if attention_dropout is None else attention_dropout,
        add_bias_linear=add_bias_linear, params_dtype=dtype, bias_dropout_fusion=False, **config,
    )
    model = GPTModel(cfg, spec if spec is not None else get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, position_embedding_type="rope")
    return model.to(dtype)


def batch(seq: int = SEQ, batch_size: int = BATCH, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    return tokens, torch.arange(seq).expand(batch_size, seq)


def loss_and_grads(model: torch.nn.Module, *, seed: int = 7, steps: int = 1,
                   around: Optional[Callable[[], Any]] = None,
                   batches: Optional[list] = None) -> tuple[torch.Tensor, dict]:
    """Forward + backward ``steps`` micro-batches (dropout drawn from ``seed``); loss sum and grads.

    ``batches``: ``(tokens, position_ids)`` pairs to use instead of :func:`batch` (e.g. a CP shard).
    """
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    total = torch.zeros((), dtype=torch.float64)
    for step in range(steps if batches is None else len(batches)):
        tokens, pos = batch(seed=step) if batches is None else batches[step]
        with around() if around is not None else contextlib.nullcontext():
            loss = model(tokens, pos, None, labels=torch.roll(tokens, -1, dims=1))
        loss = loss.double().mean()
        loss.backward()
        total += loss.detach()
    return total, {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(ref: tuple, got: tuple, rtol: float = 1e-9, atol: float = 1e-11) -> None:
    (loss_ref, grads_ref), (loss_got, grads_got) = ref, got
    torch.testing.assert_close(loss_got, loss_ref, rtol=rtol, atol=atol)
    assert grads_ref.keys() == grads_got.keys() and grads_ref
    for name, g in grads_ref.items():
        assert g.abs().sum() > 0 or "bias" in name, f"{name} got no gradient"
        torch.testing.assert_close(grads_got[name], g, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def cpu() -> contextlib.AbstractContextManager:
    return cpu_compat.enabled()
