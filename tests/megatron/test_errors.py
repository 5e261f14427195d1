"""Unsupported configurations fail early with a ValueError naming the Megatron (or --longctx-*) flag."""

import pytest
import torch

from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import WORLD
from tests.megatron.attention_kit import (
    attention_config,
    cp_attention,
    qkv_inputs,
    zigzag,
)


def test_unknown_cp_comm_type():
    with pytest.raises(ValueError, match="--cp-comm-type 'bogus'"):
        cp_attention(attention_config(cp_comm_type="bogus"))


def test_hybrid_needs_its_group_size():
    with pytest.raises(ValueError, match="--hierarchical-context-parallel-sizes"):
        cp_attention(attention_config(cp_comm_type="a2a+p2p"))


def test_softmax_type_window_pattern_attention_bias_cross_attention():
    with pytest.raises(ValueError, match="--softmax-type 'softer' is not one of vanilla, off-by-one, learnable"):
        cp_attention(attention_config(softmax_type="softer"))
    with pytest.raises(ValueError, match="--window-attn-skip-freq lists 3 layers but --num-layers is 2"):
        cp_attention(attention_config(window_size=(4, 0), window_attn_skip_freq=[1, 0, 1]))
    q, k, v, _ = qkv_inputs()
    with pytest.raises(ValueError, match="attention_bias"):
        cp_attention()(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="self-attention only"):
        cp_attention(attention_type="cross")


def test_newer_megatron_keywords_are_tolerated():
    q, k, v, _ = qkv_inputs()
    module = cp_attention(pp_layer_offset=0, a_keyword_from_a_future_megatron=True)
    assert module(q, k, v, None, a_future_forward_keyword=None).shape == (q.shape[0], q.shape[1], q.shape[2] * q.shape[3])


def test_per_layer_list_too_short():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_longctx import ContextParallelAttention

    with pytest.raises(ValueError, match="--cp-comm-type lists 1 values but layer 2"):
        ContextParallelAttention(config=attention_config(num_layers=1, cp_comm_type=["p2p"]), layer_number=2,
                                 attn_mask_type=AttnMaskType.causal)


def _cp2_errors():
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.megatron.batch import get_batch_on_this_cp_rank

    with cpu_compat.enabled(), megatron_parallel(cp=2):
        rank = parallel_state.get_context_parallel_rank()
        cfg = attention_config(context_parallel_size=2, cp_comm_type="p2p")
        q, k, v, _ = qkv_inputs()
        local = [zigzag(x, rank, 2) for x in (q, k, v)]
        dense = torch.zeros(1, 1, 8, 16, dtype=torch.bool)
        with pytest.raises(ValueError, match="arbitrary dense attention_mask.*--context-parallel-size 2"):
            cp_attention(cfg, AttnMaskType.arbitrary)(*local, dense)
        with pytest.raises(ValueError, match="--seq-length must be divisible by 2 x --context-parallel-size"):
            cp_attention(cfg)(*(x[:7] for x in local), None)
        train = cp_attention(attention_config(context_parallel_size=2, cp_comm_type="p2p", attention_dropout=0.1))
        with pytest.raises(ValueError, match="--attention-dropout 0"):
            train(*local, None)
        train.eval()
        assert train(*local, None).shape == (8, q.shape[1], q.shape[2] * q.shape[3])
        thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 8]), cu_seqlens_kv=torch.tensor([0, 8]))
        # Packed input must be this rank's share of the global cu_seqlens: 8 global tokens are 4 per rank.
        with pytest.raises(ValueError, match="cu_seqlens_padded.*per rank over cp=2"):
            cp_attention(cfg, AttnMaskType.padding_causal)(*(x[:, 0] for x in local), None, packed_seq_params=thd)
        with pytest.raises(ValueError, match="Ulysses.*--num-attention-heads"):
            cp_attention(attention_config(hidden_size=24, num_attention_heads=3, num_query_groups=1, context_parallel_size=2,
                            cp_comm_type="a2a"))
        with pytest.raises(ValueError, match="--seq-length divisible by 4"):
            get_batch_on_this_cp_rank({"tokens": torch.zeros(2, 6, dtype=torch.long)},
                                      parallel_state.get_context_parallel_group())


def test_cp_errors():
    run_ranks(WORLD, _cp2_errors)


def _batch_split():
    """Megatron's split through our helper: zigzag over the CP group, untouched when CP=1 (not WORLD)."""
    from megatron.core import parallel_state

    from megatron_longctx.megatron.batch import get_batch_on_this_cp_rank

    tokens = torch.arange(2 * 8).view(2, 8)
    mask = torch.arange(2 * 8 * 8).view(2, 1, 8, 8)
    with megatron_parallel(cp=1):
        out = get_batch_on_this_cp_rank({"tokens": tokens, "attention_mask": mask, "loss_mask": None})
        assert torch.equal(out["tokens"], tokens) and torch.equal(out["attention_mask"], mask)
    with megatron_parallel(cp=2):
        rank = parallel_state.get_context_parallel_rank()
        out = get_batch_on_this_cp_rank({"tokens": tokens, "attention_mask": mask},
                                        parallel_state.get_context_parallel_group())
        keep = [rank, 3 - rank]
        want = torch.cat([tokens.view(2, 4, 2)[:, i] for i in keep], dim=1)
        assert torch.equal(out["tokens"], want)
        want_mask = torch.cat([mask.view(2, 1, 4, 2, 8)[:, :, i] for i in keep], dim=2)
        assert torch.equal(out["attention_mask"], want_mask)


def test_batch_split_uses_the_cp_group():
    run_ranks(WORLD, _batch_split)
