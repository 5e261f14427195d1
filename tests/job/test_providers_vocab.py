"""The main job's model has Megatron's padded vocabulary: ``--make-vocab-size-divisible-by`` × TP."""

from __future__ import annotations

import types

import pytest

from megatron_longctx import data as data_mod
from megatron_longctx.job import providers


@pytest.mark.parametrize("divisor,tp", [(64, 1), (64, 2), (128, 4)])
def test_model_vocab_is_padded_as_megatron_pads_it(monkeypatch, divisor, tp):
    global_vars = pytest.importorskip("megatron.training.global_vars")
    vocab_utils = pytest.importorskip("megatron.training.vocab_utils")
    import megatron.core.models.gpt as gpt

    built = {}
    monkeypatch.setattr(gpt, "GPTModel", lambda config, spec, vocab_size, **kwargs: built.setdefault("vocab", vocab_size))
    monkeypatch.setenv(providers.BASELINE_ENV, "1")  # Megatron's own attention: no plugin flags needed
    args = types.SimpleNamespace(make_vocab_size_divisible_by=divisor, tensor_model_parallel_size=tp,
                                 qk_layernorm=False, max_position_embeddings=256, untie_embeddings_and_output_weights=True,
                                 position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
                                 use_rope_scaling=False, rope_scaling_factor=8.0,
                                 rotary_seq_len_interpolation_factor=None)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    providers.model_provider(config=object())
    tokens = data_mod.ByteTokenizer().vocab_size
    expected = vocab_utils.calculate_padded_vocab_size(tokens, divisor, tp, logging_enabled=False)
    assert built["vocab"] == expected and expected % (divisor * tp) == 0
