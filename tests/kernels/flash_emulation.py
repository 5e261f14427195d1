"""CPU stand-ins for torch's flash ops (``aten::_flash_attention_forward``/``_backward``), float64.

They follow flash-attn 2's documented semantics, including what its C++ entry points do to the
arguments (``csrc/flash_attn/flash_api.cpp``, mha_fwd/mha_bwd and set_params_fprop): bottom-right
aligned causal/windows, window sides ``>= seqlen_k`` rewritten to unbounded, an unbounded right side
next to a bounded left side rewritten to ``seqlen_k``, ``causal`` dropped for one query row, rows
that see nothing returned with ``out = 0`` and ``lse = +inf``.  They also insist on what the kernel
requires: equal head dims that are multiples of 8, no dropout.  The variable-length path (``cum_seq_q``/
``cum_seq_k`` given: q ``[T, h, d]``, lse ``[h, T]``) applies the same rules to each sequence, its
rewrites judged against ``max_q``/``max_k`` as mha_varlen_fwd judges them.  :func:`fa3_visible` holds
FlashAttention-3's rewrites; the flash-attn package's entry points per release are in
:mod:`.flash_attn_releases`.
"""

from __future__ import annotations

import types

import torch


def band(s_q: int, s_k: int, lo, hi) -> torch.Tensor:
    """``[s_q, s_k]`` bool: ``lo <= j - i <= hi`` (``None``: that side unbounded)."""
    i, j = torch.arange(s_q)[:, None], torch.arange(s_k)[None, :]
    seen = torch.ones(s_q, s_k, dtype=torch.bool)
    if lo is not None:
        seen &= j - i >= lo
    if hi is not None:
        seen &= j - i <= hi
    return seen


def flash2_visible(s_q: int, s_k: int, causal: bool, left: int, right: int, max_q: int | None = None,
                   max_k: int | None = None) -> torch.Tensor:
    """The pairs flash-attn 2 computes for these arguments, after its rewrites (which a variable-length
    call judges by the longest sequences, ``max_q``/``max_k``)."""
    max_q, max_k = max_q or s_q, max_k or s_k
    left = -1 if left >= max_k else left
    right = -1 if right >= max_k else right
    if max_q == 1:
        causal = False
    if causal:
        right = 0
    if left < 0 and right >= 0:
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    if left < 0 and right < 0:
        return torch.ones(s_q, s_k, dtype=torch.bool)
    shift = s_k - s_q
    return band(s_q, s_k, shift - left, shift + right)


def fa3_visible(s_q: int, s_k: int, causal: bool, left: int, right: int, max_q: int | None = None,
                max_k: int | None = None) -> torch.Tensor:
    """The pairs FlashAttention-3 computes (hopper/flash_api.cpp, mha_fwd and mha_bwd): a left side
    ``>= max_k - 1`` and a right side ``>= max_q - 1`` become unbounded, causal sets the right side to 0,
    and an unbounded side of a window becomes ``max_k - 1`` (left) or ``max_q - 1`` (right)."""
    max_q, max_k = max_q or s_q, max_k or s_k
    left = -1 if left >= max_k - 1 else left
    right = -1 if right >= max_q - 1 else right
    if max_q == 1 and left == -1 and right == -1:
        causal = False
    if causal:
        right = 0
    if left < 0 and right < 0:
        return torch.ones(s_q, s_k, dtype=torch.bool)
    left = max_k - 1 if left < 0 else left
    right = max_q - 1 if right < 0 else right
    shift = s_k - s_q
    return band(s_q, s_k, shift - left, shift + right)


def _checked(q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, causal, left, right, varlen=False, visible=None):
    assert dropout_p == 0.0
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0, "flash needs one 8-aligned head dim"
    assert q.shape[2] % k.shape[2] == 0
    if not varlen:
        assert cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[1], k.shape[1])
    left = -1 if left is None else left
    right = -1 if right is None else right
    assert isinstance(left, int) and isinstance(right, int) and left >= -1 and right >= -1
    seen = (visible or flash2_visible)(q.shape[1], k.shape[1], causal, left, right, max_q, max_k)
    g = q.shape[2] // k.shape[2]
    kx, vx = (t.to(torch.float64).repeat_interleave(g, dim=2) for t in (k, v))  # [b, s_k, h_q, d]
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(torch.float64), kx)
    return s, seen, kx, vx, g


def _sequences(cum_q, cum_k, max_q, max_k):
    """(q rows, k rows) of each sequence of a variable-length call, checked against the stated maxima."""
    assert cum_q.dtype == cum_k.dtype == torch.int32 and cum_q.shape == cum_k.shape and cum_q.dim() == 1
    cq, ck = cum_q.tolist(), cum_k.tolist()
    seqs = [(slice(a, b), slice(c, d)) for a, b, c, d in zip(cq, cq[1:], ck, ck[1:])]
    assert max(b - a for a, b in zip(cq, cq[1:])) <= max_q and max(d - c for c, d in zip(ck, ck[1:])) <= max_k
    return seqs, cq[-1], ck[-1]


def packed_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, left, right, visible=None):
    """A variable-length forward: q ``[T, h, d]``, k/v ``[T_k, h_kv, d]`` -> out ``[T, h, d]``, lse ``[h, T]``."""
    assert q.dim() == k.dim() == 3
    seqs, total_q, total_k = _sequences(cu_q, cu_k, max_q, max_k)
    assert (total_q, total_k) == (q.shape[0], k.shape[0])
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], total_q, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    for rows, keys in seqs:
        o, l = _dense_forward(q[rows][None], k[keys][None], v[keys][None], cu_q, cu_k, max_q, max_k, 0.0, causal,
                              scale, left, right, varlen=True, visible=visible)
        out[rows], lse[:, rows] = o[0], l[0]
    return out, lse


def packed_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, left, right, visible=None):
    """The variable-length backward of :func:`packed_forward` (lse ``[h, T]``) -> dq, dk, dv."""
    assert q.dim() == 3 and lse.shape == (q.shape[1], q.shape[0])
    seqs, _, _ = _sequences(cu_q, cu_k, max_q, max_k)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for rows, keys in seqs:
        g = _dense_backward(dout[rows][None], q[rows][None], k[keys][None], v[keys][None], out[rows][None],
                            lse[:, rows][None].contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, scale, left,
                            right, varlen=True, visible=visible)
        dq[rows], dk[keys], dv[keys] = (x[0] for x in g)
    return dq, dk, dv


def dense_forward(q, k, v, causal, scale, left, right, visible=None):
    """A dense-batch forward: q ``[b, s_q, h, d]`` -> out, lse ``[b, h, s_q]``."""
    return _dense_forward(q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, scale, left, right,
                          visible=visible)


def dense_backward(dout, q, k, v, out, lse, causal, scale, left, right, visible=None):
    return _dense_backward(dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.0, causal, scale, left,
                           right, visible=visible)


def flash_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                  *, scale=None, window_size_left=None, window_size_right=None):
    assert dropout_p == 0.0
    if cum_seq_q is not None:  # q [T, h, d], k/v [T_k, h_kv, d] -> out [T, h, d], lse [h, T]
        out, lse = packed_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
                                  window_size_left, window_size_right)
        return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(()), torch.empty(0)
    out, lse = _dense_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale,
                              window_size_left, window_size_right)
    return out, lse, torch.zeros(2, dtype=torch.uint64), torch.empty(()), torch.empty(0)


def _dense_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, scale,
                   window_size_left, window_size_right, varlen=False, visible=None):
    s, seen, _, vx, _ = _checked(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                 window_size_left, window_size_right, varlen, visible)
    s = (s * scale).masked_fill(~seen, float("-inf"))  # [b, h, s_q, s_k]
    lse = torch.logsumexp(s, dim=-1)
    dead = torch.isneginf(lse)
    p = torch.exp(s - lse.masked_fill(dead, 0.0).unsqueeze(-1)).masked_fill(dead.unsqueeze(-1), 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vx).to(query.dtype)
    lse = lse.masked_fill(dead, float("inf"))  # flash-attn 2 marks empty rows with +inf
    lse = lse.to(torch.float64 if query.dtype == torch.float64 else torch.float32)
    return out, lse


def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                   is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
    assert dropout_p == 0.0
    if cum_seq_q is not None:  # packed rows as in flash_forward; logsumexp [h, T]
        return packed_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                               is_causal, scale, window_size_left, window_size_right)
    return _dense_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                           is_causal, scale, window_size_left, window_size_right)


def _dense_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                    is_causal, scale, window_size_left, window_size_right, varlen=False, visible=None):
    s, seen, kx, vx, g = _checked(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                  window_size_left, window_size_right, varlen, visible)
    assert grad_out.dtype == out.dtype == query.dtype and logsumexp.is_contiguous()
    s = (s * scale).masked_fill(~seen, float("-inf"))
    p = torch.exp(s - logsumexp.to(torch.float64).unsqueeze(-1))  # +inf lse -> 0
    do = grad_out.to(torch.float64)
    dvx = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vx)
    delta = (do * out.to(torch.float64)).sum(-1).transpose(1, 2)  # [b, h, s_q]
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kx)
    dkx = torch.einsum("bhqk,bqhd->bkhd", ds, query.to(torch.float64))
    h_kv = key.shape[2]
    dk, dv = dkx.unflatten(2, (h_kv, g)).sum(3), dvx.unflatten(2, (h_kv, g)).sum(3)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)


def emulated_backend(name: str, kernel) -> types.SimpleNamespace:
    """A backend module called ``name`` over piece kernel ``kernel`` (whose ops are emulations): the production
    driver and variable-length arithmetic on CPU tensors, for ``select.BACKENDS[name]``."""
    from megatron_longctx.kernels import driver

    def pieces(args, q, k):
        return driver.flash2_pieces(args, q.shape[1], k.shape[1])

    return types.SimpleNamespace(
        name=name, available=lambda device: None, check=lambda q, k, v, args: None,
        forward=lambda q, k, v, args: driver.forward(kernel, pieces(args, q, k), q, k, v, args),
        backward=lambda dout, q, k, v, out, lse, args: driver.backward(kernel, pieces(args, q, k), dout, q, k, v,
                                                                       out, lse, args),
        forward_blocks=kernel.forward_blocks, backward_blocks=kernel.backward_blocks)
