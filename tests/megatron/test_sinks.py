"""Attention sinks (``--softmax-type off-by-one|learnable``) through ContextParallelAttention in a GPTModel,
against Megatron's own local ``DotProductAttention`` (``SoftmaxOne``) at CP=1.

The learnable ``softmax_offset`` is drawn far from its small init so the sinks matter; every gradient is
compared, the offset's included (summed over the CP ranks, as DDP's ``dp_cp`` reduction does).  The
gpt-oss-shaped model alternates sliding-window and full layers (``--window-size`` with
``--window-attn-skip-freq 2``) with sinks, GQA, RoPE and SwiGLU.  Checkpoints move between Megatron's
model and the plugin's both ways, with the offset sharded over TP as Megatron shards it.
"""

import io
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import WORLD, build_gpt, local_spec, loss_and_grads, tiny_config
from tests.gpt_kit import batch as global_batch

OFFSET = "self_attention.core_attention.softmax_offset"
GPT_OSS = {"window_size": (4, 0), "window_attn_skip_freq": 2, "gated_linear_unit": True,
           "activation_func": F.silu, "normalization": "RMSNorm", "add_bias_linear": False}


def _megatron_reference(tp: int, batch, **fields):
    """Megatron's local-spec GPT at CP=1 with random sinks: (its state, loss, grads)."""
    from megatron_longctx.megatron import cpu_compat

    base = build_gpt(tiny_config(tp, 1, **fields), local_spec())
    gen = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("softmax_offset"):
                p.copy_(torch.randn(p.shape, generator=gen) * 2)
    with cpu_compat.enabled():  # Megatron's window mask is made on the CPU
        loss, grads = loss_and_grads(base, batch)
    return base.state_dict(), loss, grads


def _assert_same(case, loss, grads, ref_loss, ref_grads):
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: loss {m}")
    assert grads.keys() == ref_grads.keys()
    learnable = [n for n in ref_grads if n.endswith(OFFSET)]
    assert learnable or "off-by-one" in str(case), (case, list(ref_grads))
    for name, ref in ref_grads.items():
        assert ref.abs().sum() > 0, f"{case}: {name} got no gradient in the reference"
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=2e-6, msg=lambda m: f"{case} {name}: {m}")


def _cp1_body():
    from megatron_longctx import apply_to_spec
    from megatron_longctx.megatron import cpu_compat

    batch = global_batch(seed=5)
    with cpu_compat.enabled(), megatron_parallel(tp=2):
        for softmax_type in ("learnable", "off-by-one"):
            state, ref_loss, ref_grads = _megatron_reference(2, batch, softmax_type=softmax_type)
            model = build_gpt(tiny_config(2, 1, softmax_type=softmax_type), apply_to_spec(local_spec()), seed=7)
            model.load_state_dict(state)
            loss, grads = loss_and_grads(model, batch)
            _assert_same(("tp2", softmax_type), loss, grads, ref_loss, ref_grads)


def test_cp1_with_sinks_matches_megatron():
    """TP=2, CP=1: the plugin's kernels with sinks equal Megatron's SoftmaxOne, the offset's gradient included."""
    run_ranks(WORLD, _cp1_body)


def _cp_body(fields, cases):
    """Megatron's CP=1 reference of ``fields`` once, then the plugin at each (cp, --cp-comm-type) of ``cases``."""
    from megatron.core import parallel_state

    from megatron_longctx import apply_to_spec
    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.megatron.batch import get_batch_on_this_cp_rank

    batch = global_batch(seed=3)
    with cpu_compat.enabled():
        with megatron_parallel(tp=1, cp=1):
            state, ref_loss, ref_grads = _megatron_reference(1, batch, **fields)
        for cp, comm in cases:
            with megatron_parallel(tp=1, cp=cp):
                model = build_gpt(tiny_config(1, cp, cp_comm_type=comm, **fields), apply_to_spec(local_spec()),
                                  seed=99)
                model.load_state_dict(state)
                cp_group = parallel_state.get_context_parallel_group()
                local = get_batch_on_this_cp_rank(batch, cp_group)
                loss, grads = loss_and_grads(model, local, cp_group, total_tokens=batch["loss_mask"].sum())
                windows = [layer.self_attention.core_attention.settings.window_size for layer in model.decoder.layers]
            if "window_attn_skip_freq" in fields:
                assert windows == [fields["window_size"], None], windows  # layer 2 of every 2 is full
            _assert_same((cp, comm, fields["softmax_type"]), loss, grads, ref_loss, ref_grads)


# (config fields, [(cp, --cp-comm-type)]): Megatron's CP=1 reference is computed once per entry.
CP_CASES = {
    "learnable": ({"softmax_type": "learnable"}, [(2, "p2p"), (2, "a2a"), (4, "a2a")]),
    "off-by-one": ({"softmax_type": "off-by-one"}, [(2, "all_gather")]),
    "gpt-oss": ({"softmax_type": "learnable", **GPT_OSS}, [(2, "p2p"), (2, "a2a"), (2, "all_gather")]),
}


@pytest.mark.parametrize("name", list(CP_CASES))
def test_cp_with_sinks_matches_megatron_cp1(name):
    run_ranks(WORLD, _cp_body, *CP_CASES[name])


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _checkpoint_body():
    from megatron_longctx import apply_to_spec
    from megatron_longctx.megatron import cpu_compat

    batch = global_batch(seed=8)
    with cpu_compat.enabled(), megatron_parallel(tp=2):
        base = build_gpt(tiny_config(2, 1, softmax_type="learnable"), local_spec())
        plugin = build_gpt(tiny_config(2, 1, softmax_type="learnable"), apply_to_spec(local_spec()), seed=77)
        assert base.state_dict().keys() == plugin.state_dict().keys()
        ours, theirs = plugin.sharded_state_dict(), base.sharded_state_dict()
        assert ours.keys() == theirs.keys()
        keys = [k for k in ours if k.endswith(OFFSET)]
        assert len(keys) == 2, keys
        fields = ("key", "local_shape", "global_shape", "global_offset", "replica_id", "axis_fragmentations")
        for key in keys:  # saved stacked over the layers, [layers, heads], the heads sharded over TP
            assert [getattr(ours[key], f) for f in fields] == [getattr(theirs[key], f) for f in fields]
            assert (tuple(ours[key].global_shape), tuple(ours[key].local_shape)) == ((2, 4), (2,)), ours[key]

        def loss(model):
            return loss_and_grads(model, batch)[0]

        plugin.load_state_dict(_roundtrip(base.state_dict()))  # Megatron -> plugin
        torch.testing.assert_close(loss(plugin), loss(base), rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            for name, p in plugin.named_parameters():
                p.add_((1.0 if name.endswith("softmax_offset") else 0.01) * torch.randn_like(p))
        base.load_state_dict(_roundtrip(plugin.state_dict()))  # plugin -> Megatron
        torch.testing.assert_close(loss(base), loss(plugin), rtol=1e-5, atol=1e-6)


def test_checkpoint_with_sinks_loads_both_ways():
    run_ranks(WORLD, _checkpoint_body)


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
def test_local_path_with_a_dense_mask_and_sinks_matches_float64(softmax_type):
    """One CP rank with an arbitrary mask takes the local math path: the sink as one more score column."""
    import math

    from megatron.core.transformer.enums import AttnMaskType

    from tests import oracle
    from tests.megatron.attention_kit import HQ, S, D, attention_config, cp_attention, qkv_inputs

    module = cp_attention(attention_config(softmax_type=softmax_type, params_dtype=torch.float64),
                          AttnMaskType.arbitrary)
    if softmax_type == "learnable":
        with torch.no_grad():
            module.softmax_offset.copy_(torch.randn(HQ, generator=torch.Generator().manual_seed(1),
                                                    dtype=torch.float64))
    masked = torch.rand(S, S, generator=torch.Generator().manual_seed(3)) > 0.6
    masked[3] = True  # a row that sees no key: out 0, the sink takes all the weight
    q, k, v, dout = qkv_inputs(seed=6)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = module(*leaves, masked.view(1, 1, S, S))
    out.backward(dout)
    sink = module.softmax_offset.detach().clone().requires_grad_(softmax_type == "learnable")
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = oracle.sequence_attention(*ref_in, False, None, 1 / math.sqrt(D), ~masked, sink=sink).flatten(2)
    wrt = ref_in + ([sink] if sink.requires_grad else [])
    ref_grads = torch.autograd.grad(ref, wrt, dout)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
    got = [x.grad for x in leaves] + ([module.softmax_offset.grad] if sink.requires_grad else [])
    for g, r in zip(got, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
