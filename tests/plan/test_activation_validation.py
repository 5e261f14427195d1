"""The planner's activation model against bytes a real Megatron GPTModel saves for backward on the CPU.

Each rank builds tiny GPTModels (local spec, float32, TP = 2 without sequence parallelism: the torch
LayerNorm of the local spec refuses it) with 1 and with 3 layers, counts the bytes saved for backward
during one forward through ``torch.autograd.graph.saved_tensors_hooks`` (deduplicated by storage,
parameters excluded), and takes half the difference as the bytes of one layer; embeddings, logits and
buffers shared by every layer (the causal mask) cancel.  The prediction must be within 15%.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_longctx.megatron import cpu_compat
from megatron_longctx.plan.memory import saved_per_layer
from megatron_longctx.plan.model import MemoryOptions, ModelShape, Parallel, layer_activations
from tests.dist import megatron_parallel, run_ranks

BATCH, VOCAB = 2, 64


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    heads: int
    groups: int
    hidden: int
    ffn: int
    swiglu: bool
    dropout: float
    seq: int = 64
    rope: bool = True


CASES = [
    Case("gqa-gelu-rope", heads=4, groups=2, hidden=64, ffn=128, swiglu=False, dropout=0.0, seq=128),
    Case("mha-swiglu-dropout", heads=4, groups=4, hidden=64, ffn=192, swiglu=True, dropout=0.1),
    Case("mha-gelu-learned-pos", heads=8, groups=8, hidden=128, ffn=512, swiglu=False, dropout=0.0, rope=False),
]


def saved_bytes(model: torch.nn.Module, *inputs) -> int:
    """Bytes of distinct storages saved for backward during ``model(*inputs)``, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*inputs)
    assert out.requires_grad
    return sum(storages.values())


def _measure_layer_bytes(case: Case, tp: int, spec_fn=None, cp: int = 1, recompute: bool = False) -> float:
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    totals = []
    with cpu_compat.enabled(), megatron_parallel(tp=tp, cp=cp):
        for layers in (1, 3):
            torch.manual_seed(0)
            model_parallel_cuda_manual_seed(0)
            # SwiGLU as Megatron-LM's --swiglu builds it: gated, SiLU, fused bias-SwiGLU.
            extra = dict(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True) if case.swiglu else {}
            if recompute:
                extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
            cfg = TransformerConfig(
                num_layers=layers, hidden_size=case.hidden, num_attention_heads=case.heads,
                num_query_groups=case.groups, ffn_hidden_size=case.ffn, use_cpu_initialization=True,
                tensor_model_parallel_size=tp, context_parallel_size=cp, add_bias_linear=False,
                hidden_dropout=case.dropout, attention_dropout=case.dropout, **extra,
            )
            spec = get_gpt_layer_local_spec()
            if spec_fn is not None:
                spec = spec_fn(spec)
            model = GPTModel(cfg, spec, vocab_size=VOCAB, max_sequence_length=case.seq,
                             position_embedding_type="rope" if case.rope else "learned_absolute")
            g = torch.Generator().manual_seed(1)
            s_local = case.seq // cp
            tokens = torch.randint(0, VOCAB, (BATCH, s_local), generator=g)
            position_ids = torch.arange(s_local).expand(BATCH, s_local)
            totals.append(saved_bytes(model, tokens, position_ids, None))
    return (totals[1] - totals[0]) / 2


def _predict(case: Case, tp: int, impl: str, cp: int = 1, recompute: str = "none") -> float:
    shape = ModelShape(
        name=case.name, num_layers=1, hidden_size=case.hidden, num_attention_heads=case.heads,
        num_query_groups=case.groups, kv_channels=case.hidden // case.heads, ffn_hidden_size=case.ffn,
        vocab_size=VOCAB, activation="swiglu" if case.swiglu else "gelu", normalization="LayerNorm",
        rope=case.rope,
    )
    # float32 (e = 4); dropout on the CPU keeps a float noise tensor, not CUDA's bool mask; RoPE unfused.
    opt = MemoryOptions(attention_impl=impl, bytes_per_element=4, attention_dropout=case.dropout,
                        hidden_dropout=case.dropout, sequence_parallel=False, fused_rope=False, dropout_mask_bytes=4,
                        recompute=recompute)
    par = Parallel(tp=tp, cp=cp, micro_batch=BATCH)
    if recompute != "none":
        return saved_per_layer(shape, case.seq, par, opt)
    return layer_activations(shape, case.seq, par, opt).total


def _local_body(case: Case) -> tuple[float, float, float]:
    measured = _measure_layer_bytes(case, tp=2)
    return measured, _predict(case, tp=2, impl="local"), _predict(case, tp=2, impl="flash")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_local_attention_activation_bytes_within_15_percent(case):
    measured, predicted, _ = run_ranks(2, _local_body, case)[0]
    assert measured > 0
    assert abs(predicted - measured) <= 0.15 * measured, f"{case.name}: measured {measured}, predicted {predicted}"


def test_validation_can_fail_when_the_attention_model_is_wrong():
    # At s = 128 the s x s probabilities are a third of the layer: the flash-style model, which
    # omits them, must miss the measured bytes of Megatron's local attention by more than 15%.
    measured, _, flash = run_ranks(2, _local_body, CASES[0])[0]
    assert abs(flash - measured) > 0.15 * measured


def _cp_body(case: Case, algorithm: str) -> tuple[float, float]:
    from megatron_longctx.megatron.spec import apply_to_spec

    measured = _measure_layer_bytes(case, tp=1, cp=2, spec_fn=lambda spec: apply_to_spec(spec, cp_algorithm=algorithm))
    return measured, _predict(case, tp=1, impl="flash", cp=2)


@pytest.mark.parametrize("algorithm", ["ring", "ulysses"])
@pytest.mark.parametrize("case", [c for c in CASES if c.dropout == 0.0], ids=lambda c: c.name)
def test_context_parallel_attention_activation_bytes_within_15_percent(case, algorithm):
    # megatron_longctx's ContextParallelAttention (CP = 2) keeps flash-style state: q, k, v, out, lse.
    for measured, predicted in run_ranks(2, _cp_body, case, algorithm):
        assert measured > 0
        assert abs(predicted - measured) <= 0.15 * measured, (
            f"{case.name}/{algorithm}: measured {measured}, predicted {predicted}")


def _recompute_body(case: Case) -> tuple[float, float]:
    return _measure_layer_bytes(case, tp=2, recompute=True), _predict(case, tp=2, impl="local", recompute="full")


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: c.name)
def test_full_recompute_keeps_only_the_layer_input(case):
    # Megatron's full recompute (uniform, 1 layer per checkpoint) saves each layer's input alone.
    measured, predicted = run_ranks(2, _recompute_body, case)[0]
    assert measured > 0
    assert abs(predicted - measured) <= 0.15 * measured, f"{case.name}: measured {measured}, predicted {predicted}"
