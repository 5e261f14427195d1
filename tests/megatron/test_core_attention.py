"""ContextParallelAttention as Megatron calls it, against plain float64 attention math.

Outputs and gradients of q/k/v are compared with ``assert_close`` on CPU; CP>1 cases run on gloo ranks,
each holding Megatron's zigzag shard (chunks r and 2cp-1-r) of one global sequence.
"""

import math

import pytest
import torch

from tests.dist import megatron_parallel, run_ranks
from tests.megatron._models import WORLD

S, B, HQ, HKV, D = 16, 2, 4, 2, 8


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=HQ * D, num_attention_heads=HQ, num_query_groups=HKV, kv_channels=D,
                attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True)
    base.update(overrides)
    return TransformerConfig(**base)


def _module(config=None, mask_type=None, **kwargs):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_longctx import ContextParallelAttention

    kwargs.setdefault("attention_type", "self")
    return ContextParallelAttention(config=config or _config(), layer_number=1,
                                    attn_mask_type=mask_type or AttnMaskType.causal, **kwargs)


def reference(q, k, v, scale, causal=True, window=None, visible=None):
    """Plain float64 attention: q [s, b, hq, d], k/v [s, b, hkv, d] -> [s, b, hq*dv]."""
    q, k, v = (x.double() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    s = q.shape[0]
    dist = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    see = torch.ones(s, s, dtype=torch.bool)
    if causal:
        see &= dist >= 0
    if window is not None:
        see &= dist <= window[0]
        if not causal and window[1] >= 0:
            see &= dist >= -window[1]
    if visible is not None:
        see = see & visible
    probs = torch.softmax(scores.masked_fill(~see, float("-inf")), -1).nan_to_num(0.0)
    out = torch.einsum("bhqk,kbhd->qbhd", probs, v)
    return out.reshape(s, q.shape[1], -1)


def _inputs(seed=0, dv=D, hq=HQ, hkv=HKV, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, hq, D, generator=g, dtype=dtype)
    k = torch.randn(S, B, hkv, D, generator=g, dtype=dtype)
    v = torch.randn(S, B, hkv, dv, generator=g, dtype=dtype)
    dout = torch.randn(S, B, hq * dv, generator=g, dtype=dtype)
    return q, k, v, dout


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
    q, k, v, dout = _inputs(dv=dv, hkv=hkv)
    attention_mask = None
    if case == "dense_mask":
        mask_type, causal = AttnMaskType.arbitrary, False
        masked = torch.rand(S, S, generator=torch.Generator().manual_seed(3)) > 0.6
        masked[:, 0] = False
        attention_mask, mask = masked.view(1, 1, S, S), ~masked
    module = _module(_config(**cfg), mask_type, **kwargs)
    got = _grads(lambda a, b, c: module(a, b, c, attention_mask), q, k, v, dout)
    scale = kwargs.get("softmax_scale", 1 / math.sqrt(D))
    want = _grads(lambda a, b, c: reference(a, b, c, scale, causal, window, mask), q, k, v, dout)
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(x, y, rtol=1e-7, atol=1e-9, msg=lambda m: f"{case} {name}: {m}")


def _dropout_body():
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_longctx import cpu_compat

    with cpu_compat.enabled(), megatron_parallel():
        module = _module(_config(attention_dropout=0.5))
        q, k, v, _ = _inputs(seed=2)
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


def _zigzag(x, rank, cp):
    chunks = x.chunk(2 * cp, dim=0)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=0)


def _cp_body(cases, cp):
    from megatron.core import parallel_state

    from megatron_longctx import cpu_compat
    from megatron_longctx.config import ContextParallelConfig

    with cpu_compat.enabled(), megatron_parallel(cp=cp):
        rank = parallel_state.get_context_parallel_rank()
        for comm, window in cases:
            cfg = _config(context_parallel_size=cp, cp_comm_type=comm, window_size=window)
            module = _module(cfg, cp_comm_type=comm, cp_config=ContextParallelConfig(cp_kernel_backend="reference"))
            q, k, v, dout = _inputs(seed=11)
            local = [_zigzag(x, rank, cp) for x in (q, k, v, dout)]
            got = _grads(lambda a, b, c: module(a, b, c, None), *local)
            want = _grads(lambda a, b, c: reference(a, b, c, 1 / math.sqrt(D), True, window), q, k, v, dout)
            for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
                torch.testing.assert_close(x, _zigzag(y, rank, cp), rtol=1e-7, atol=1e-9,
                                           msg=lambda m: f"cp={cp} {comm} {window} {name}: {m}")


CP_CASES = [("p2p", None), ("all_gather", None), ("a2a", None), ("p2p", (5, 0)), ("all_gather", (3, 0))]


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_matches_float64_reference(cp):
    run_ranks(WORLD, _cp_body, CP_CASES if cp == 2 else CP_CASES[::2], cp)


def test_packed_thd_one_rank():
    """THD: documents attend only to themselves; padding between documents gets zeros."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    lens, padded = [5, 3, 6], [6, 4, 6]
    cu = torch.tensor([0, 5, 8, 14], dtype=torch.int32)
    cu_pad = torch.tensor([0, 6, 10, 16], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                             cu_seqlens_kv_padded=cu_pad, max_seqlen_q=6, max_seqlen_kv=6)
    q, k, v, _ = _inputs(seed=4)
    q, k, v = q[:, 0], k[:, 0], v[:, 0]  # [t, h, d]
    dout = torch.randn(S, HQ * D, dtype=torch.float64)
    module = _module(mask_type=AttnMaskType.padding_causal)
    got = _grads(lambda a, b, c: module(a, b, c, None, packed_seq_params=params), q, k, v, dout)

    def ref(a, b, c):
        out = a.new_zeros(S, HQ * D)
        pieces = []
        for start, n in zip(cu_pad[:-1].tolist(), lens):
            sl = slice(start, start + n)
            pieces.append((sl, reference(a[sl, None], b[sl, None], c[sl, None], 1 / math.sqrt(D))[:, 0]))
        for sl, piece in pieces:
            out = out.index_copy(0, torch.arange(sl.start, sl.stop), piece)
        return out

    want = _grads(ref, q, k, v, dout)
    assert padded == (cu_pad[1:] - cu_pad[:-1]).tolist()
    for name, x, y in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(x, y, rtol=1e-7, atol=1e-9, msg=lambda m: f"thd {name}: {m}")
