"""Local attention reads no device tensor back per call: cu_seqlens go to the host once per batch.

On CUDA each ``.tolist()`` of a device ``cu_seqlens`` is a device synchronisation; the CPU shows it as
a count of host transfers (``Tensor.tolist`` calls).  Outputs and gradients are checked against a
float64 per-document oracle, and against the dense-mask path for the empty-row shortcut.
"""

import pytest
import torch

from megatron_longctx.megatron import local_attention as la


@pytest.fixture
def tolist_calls(monkeypatch):
    calls = []
    original = torch.Tensor.tolist

    def counting(self):
        calls.append(self.numel())
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    return calls


def _oracle(q, k, v, cu, scale):
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        g = q.shape[1] // k.shape[1]
        kd, vd = k[a:b].repeat_interleave(g, 1), v[a:b].repeat_interleave(g, 1)  # [l, hq, d]
        s = torch.einsum("qhd,khd->hqk", q[a:b], kd) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vd)
    return out


def test_cu_seqlens_read_once_per_batch_and_outputs_match(tolist_calls):
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    q = torch.randn(20, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(20, 2, 8, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    args = la.LocalAttentionArgs(softmax_scale=8 ** -0.5, causal=True)
    cu_kv = cu.clone()
    outs = [la.local_attention_thd(q, k, v, args, cu, cu_kv) for _ in range(4)]  # 4 layers of one batch
    assert tolist_calls == [2 * 4]  # one transfer of both offset vectors, then none
    ref = _oracle(q, k, v, cu, 8 ** -0.5)
    torch.testing.assert_close(outs[0], ref)
    dout = torch.randn_like(ref)
    got = torch.autograd.grad(outs[0], (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    cu[2] = 10  # modified in place: read again
    want = _oracle(q, k, v, cu, 8 ** -0.5)
    tolist_calls.clear()
    torch.testing.assert_close(la.local_attention_thd(q, k, v, args, cu, cu), want)
    assert tolist_calls == [4]


@pytest.mark.parametrize("sq,sk,window,causal", [(4, 9, (2, -1), True), (9, 4, (-1, -1), True), (6, 6, (1, 1), False),
                                                 (3, 12, (-1, 0), False), (12, 3, (2, 0), False), (5, 5, (0, -1), True)])
def test_empty_rows_known_on_the_host(sq, sk, window, causal):
    args = la.LocalAttentionArgs(softmax_scale=1.0, causal=causal, window_size=window)
    visible = la._visible(sq, sk, args, torch.device("cpu"))
    expected = bool((~visible.any(-1)).any()) if visible is not None else False
    assert la._empty_rows(sq, sk, args) == expected
