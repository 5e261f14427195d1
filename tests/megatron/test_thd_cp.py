"""Packed (THD) sequences through a whole GPTModel under CP: same loss and gradients as CP=1.

The batch is split with this package's ``get_batch_on_this_cp_rank`` (which takes the per-document
zigzag for packed batches), RoPE is Megatron's own THD slicing, attention is ContextParallelAttention.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import VOCAB, build_gpt, local_spec, tiny_config

LENGTHS = (5, 1, 13, 3)  # a document of one token, lengths not divisible by 2·cp


def _params(fields):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(**{f.name: getattr(fields, f.name) for f in dataclasses.fields(fields)})


def _packed_model(spec, cp, comm, seed, **config):
    from megatron.core.transformer.enums import AttnMaskType

    model = build_gpt(tiny_config(1, cp, cp_comm_type=comm, **config), spec, seed=seed)
    for layer in model.decoder.layers:
        layer.self_attention.core_attention.attn_mask_type = AttnMaskType.padding_causal
    return model


def _thd_matches_cp1(cases, **config):
    from megatron.core import parallel_state

    from megatron_longctx import apply_to_spec
    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.attention import Packing, packed_batch_on_this_cp_rank, pad_packed
    from megatron_longctx.megatron.batch import get_batch_on_this_cp_rank

    cp = dist.get_world_size()
    packing = Packing.from_lengths(LENGTHS, cp)
    g = torch.Generator().manual_seed(0)
    tokens = pad_packed(torch.randint(0, VOCAB, (packing.total,), generator=g), packing)[None]  # [1, t_padded]
    labels = pad_packed(torch.randint(0, VOCAB, (packing.total,), generator=g), packing)[None]
    batch = {"tokens": tokens, "labels": labels, "loss_mask": None, "position_ids": None,
             "cu_seqlens": packing.cu_seqlens, "cu_seqlens_padded": packing.cu_seqlens_padded}
    results = []
    with cpu_compat.enabled():
        full, fields = packed_batch_on_this_cp_rank(batch, packing, 0, 1)
        with megatron_parallel(cp=1):
            base = _packed_model(apply_to_spec(local_spec()), 1, None, seed=1, **config)
            per_token = base(full["tokens"], full["position_ids"], None, labels=full["labels"],
                             packed_seq_params=_params(fields))  # [1, t]
            ref_loss = (per_token.float() * full["loss_mask"]).sum() / full["loss_mask"].sum()
            ref_loss.backward()
            ref_grads = {n: p.grad.clone() for n, p in base.named_parameters()}
            state = base.state_dict()
        for comm, algorithm in cases:
            options = {"cp_algorithm": algorithm, "cp_ulysses_size": 2} if algorithm == "hybrid" else {}
            with megatron_parallel(cp=cp):
                model = _packed_model(apply_to_spec(local_spec(), **options), cp, comm, seed=99, **config)
                model.load_state_dict(state)
                cp_group = parallel_state.get_context_parallel_group()
                local = get_batch_on_this_cp_rank(dict(batch), cp_group)
                per_token = model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                                  packed_seq_params=_params(fields))  # [1, t/cp]
                loss = (per_token.float() * local["loss_mask"]).sum() / full["loss_mask"].sum()
                loss.backward()
                loss = loss.detach().clone()
                dist.all_reduce(loss, group=cp_group)
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                for t in grads.values():
                    dist.all_reduce(t, group=cp_group)  # what DDP does over dp_cp
            torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
            assert grads.keys() == ref_grads.keys()
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=2e-6,
                                           msg=lambda m, name=name: f"{comm}/{algorithm} {name}: {m}")
            results.append(float(loss))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_packed_gpt_under_cp_matches_cp1(world_size):
    cases = [("p2p", "auto"), ("all_gather", "auto"), ("a2a", "auto")]
    if world_size == 4:
        cases.append(("p2p", "hybrid"))
    losses = run_ranks(world_size, _thd_matches_cp1, cases)
    assert all(len(r) == len(cases) for r in losses)


def test_packed_gpt_with_sinks_under_cp_matches_cp1():
    """Learnable sinks on packed documents: CP=2 (kernels, sink after the merge) equals CP=1 (the local math
    path, the sink as one more score column), the offsets' gradients included."""
    losses = run_ranks(2, _thd_matches_cp1, [("p2p", "auto"), ("a2a", "auto")], softmax_type="learnable")
    assert all(len(r) == 2 for r in losses)
