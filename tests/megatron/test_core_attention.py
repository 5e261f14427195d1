"""ContextParallelAttention as Megatron calls it, against plain float64 attention math.

Outputs and gradients of q/k/v are compared with ``assert_close`` on CPU; CP>1 cases run on gloo ranks,
each holding Megatron's zigzag shard (chunks r and 2cp-1-r) of one global sequence.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from tests import oracle
from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import WORLD
from tests.megatron.attention_kit import (
    HKV,
    HQ,
    D,
    S,
    attention_config,
    cp_attention,
    qkv_inputs,
    zigzag,
)


def reference(q, k, v, scale, causal=True, window=None, mask=None):
    """tests/oracle.py's float64 attention: q [s, b, hq, d], k/v [s, b, hkv, d] -> [s, b, hq*dv]."""
    return oracle.sequence_attention(q, k, v, causal, window, scale, mask).flatten(2)


def _grads(fn, q, k, v, dout):
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("case", ["causal", "no_mask", "window", "mqa", "mla_dims", "dense_mask", "scale"])
def test_one_rank_matches_float64_reference(case):
    from megatron.core.transformer.enums import AttnMaskType

    dv, hkv, cfg, kwargs, window, causal, mask = D, HKV, {}, {}, None, True, None
    mask_type = AttnMaskType.causal
    if case == "no_mask":
        mask_type, causal = AttnMaskType.no_mask, False
    if case == "window":
        cfg["window_size"], window = (3, 0), (3, 0)
    if case == "mqa":
        hkv, cfg["num_query_groups"] = 1, 1
    if case == "mla_dims":
        dv, kwargs = 6, {"k_channels": D, "v_channels": 6}
        hkv, cfg["num_query_groups"] = HQ, HQ
    if case == "scale":
        kwargs["softmax_scale"] = 0.3
    q, k, v, dout = qkv_inputs(dv=dv, hkv=hkv)
    attention_mask = None
    if case == "dense_mask":
        mask_type, causal = AttnMaskType.arbitrary, False
        masked = torch.rand(S, S, generator=torch.Generator().manual_seed(3)) > 0.6
        masked[:, 0] = False
        attention_mask, mask = masked.view(1, 1, S, S), ~masked
    module = cp_attention(attention_config(**cfg), mask_type, **kwargs)
    got = _grads(lambda a, b, c: module(a, b, c, attention_mask), q, k, v, dout)
    scale = kwargs.get("softmax_scale", 1 / math.sqrt(D))
    want = _grads(lambda a, b, c: reference(a, b, c, scale, causal, window, mask), q, k, v, dout)
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(x, y, rtol=1e-7, atol=1e-9, msg=lambda m: f"{case} {name}: {m}")


def _dropout_body():
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_longctx.megatron import cpu_compat

    with cpu_compat.enabled(), megatron_parallel():
        module = cp_attention(attention_config(attention_dropout=0.5))
        q, k, v, _ = qkv_inputs(seed=2)
        module.eval()
        plain = module(q, k, v, None)
        torch.testing.assert_close(plain, reference(q, k, v, 1 / math.sqrt(D)), rtol=1e-7, atol=1e-9)
        module.train()
        model_parallel_cuda_manual_seed(5)
        a = module(q, k, v, None)
        model_parallel_cuda_manual_seed(5)
        b = module(q, k, v, None)
        assert not torch.allclose(a, plain)
        torch.testing.assert_close(a, b)


def test_dropout_one_rank():
    """Attention dropout works with one CP rank (training only) and draws from Megatron's TP RNG stream."""
    run_ranks(WORLD, _dropout_body)


def _cp_body(cp, comm, window):
    from megatron.core import parallel_state

    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.config import ContextParallelConfig

    with cpu_compat.enabled(), megatron_parallel(cp=cp):
        rank = parallel_state.get_context_parallel_rank()
        cfg = attention_config(context_parallel_size=cp, cp_comm_type=comm, window_size=window)
        module = cp_attention(cfg, cp_comm_type=comm, cp_config=ContextParallelConfig(cp_kernel_backend="reference"))
        q, k, v, dout = qkv_inputs(seed=11)
        local = [zigzag(x, rank, cp) for x in (q, k, v, dout)]
        got = _grads(lambda a, b, c: module(a, b, c, None), *local)
        want = _grads(lambda a, b, c: reference(a, b, c, 1 / math.sqrt(D), True, window), q, k, v, dout)
        for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(x, zigzag(y, rank, cp), rtol=1e-7, atol=1e-9,
                                       msg=lambda m: f"cp={cp} {comm} {window} {name}: {m}")


CP_CASES = [("p2p", None), ("all_gather", None), ("a2a", None), ("p2p", (5, 0)), ("all_gather", (3, 0))]


@pytest.mark.parametrize("cp, comm, window", [
    pytest.param(cp, comm, window, id=f"cp{cp}-{comm}" + (f"-window{window[0]}" if window else ""))
    for cp, cases in ((2, CP_CASES), (4, CP_CASES[::2])) for comm, window in cases
])
def test_cp_matches_float64_reference(cp, comm, window):
    run_ranks(WORLD, _cp_body, cp, comm, window)


def test_packed_thd_one_rank():
    """THD: documents attend only to themselves; padding between documents gets zeros."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    lens, padded = [5, 3, 6], [6, 4, 6]
    cu = torch.tensor([0, 5, 8, 14], dtype=torch.int32)
    cu_pad = torch.tensor([0, 6, 10, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                             cu_seqlens_kv_padded=cu_pad, max_seqlen_q=6, max_seqlen_kv=6)
    q, k, v, _ = qkv_inputs(seed=4)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]  # [t, h, d]
    dout = torch.randn(S, HQ * D, dtype=torch.float64)
    module = cp_attention(mask_type=AttnMaskType.padding_causal)
    got = _grads(lambda a, b, c: module(a, b, c, None, packed_seq_params=params), q, k, v, dout)

    def ref(a, b, c):
        packing = SimpleNamespace(cu_seqlens_padded=cu_pad[:-1].tolist(), lengths=lens)
        return oracle.document_attention(a, b, c, packing, True, None, 1 / math.sqrt(D)).flatten(1)

    want = _grads(ref, q, k, v, dout)
    assert padded == (cu_pad[1:] - cu_pad[:-1]).tolist()
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(x, y, rtol=1e-7, atol=1e-9, msg=lambda m: f"thd {name}: {m}")
