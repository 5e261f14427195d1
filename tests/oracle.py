"""The float64 attention oracle every attention test compares against, written from the definition.

``softmax(q kᵀ · scale + mask) v`` with the mask spelled out position by position, K/V heads shared by
``h_q / h_kv`` query heads (GQA/MQA), ``d_v`` free (MLA).  Rows that see no key give ``out = 0``,
``lse = -inf`` and no gradient.  ``sink`` ``[h_q]`` (attention sinks): one more column of the scores
per head, with no value, exactly as Megatron's ``SoftmaxOne`` appends it.  Differentiable by autograd,
so gradients come from the same source.
"""

from __future__ import annotations

import torch


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window) -> torch.Tensor:
    """``[s_q, s_k]`` bool: query at ``q_pos[i]`` sees key at ``k_pos[j]`` (flash-attn's convention:
    ``window=(left, right)``, ``-1`` unbounded, the right side 0 under ``causal``)."""
    left, right = window if window is not None else (-1, -1)
    gap = q_pos[:, None] - k_pos[None, :]  # query position - key position
    seen = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    if causal:
        seen &= gap >= 0
    elif right >= 0:
        seen &= -gap <= right
    if left >= 0:
        seen &= gap <= left
    return seen


def attention(q, k, v, scale: float, seen: torch.Tensor, sink=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[b, s_q, h_q, d_qk]``, k ``[b, s_k, h_kv, d_qk]``, v ``[b, s_k, h_kv, d_v]``, seen ``[s_q, s_k]``
    -> out ``[b, s_q, h_q, d_v]``, lse ``[b, h_q, s_q]``."""
    g = q.shape[2] // k.shape[2]
    kx, vx = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)  # [b, s_k, h_q, d]
    s = torch.einsum("bqhd,bkhd->bhqk", q, kx) * scale
    if sink is not None:  # [b, h, s_q, s_k] -> [b, h, s_q, s_k + 1]: the sink's column last
        column = sink.view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        s = torch.cat([s.masked_fill(~seen, float("-inf")), column], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
        return torch.einsum("bhqk,bkhd->bqhd", p, vx), torch.logsumexp(s, dim=-1)
    live = seen.any(dim=1)  # [s_q]
    s = s.masked_fill(~seen, float("-inf")).masked_fill(~live[:, None], 0.0)
    p = torch.softmax(s, dim=-1) * live[:, None]
    lse = torch.logsumexp(s, dim=-1).masked_fill(~live, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", p, vx), lse


def sequence_attention(q, k, v, causal: bool, window, scale: float, mask=None, sink=None) -> torch.Tensor:
    """Megatron's ``[s, b, h, d]`` self-attention over the whole sequence -> out ``[s, b, h_q, d_v]``;
    ``mask``: an ``[s, s]`` bool of the pairs that may attend at all (a dense mask), on top of the rest."""
    pos = torch.arange(q.shape[0])
    seen = visible(pos, pos, causal, window)
    out, _ = attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale,
                       seen if mask is None else seen & mask, sink)  # [b, s, h_q, d_v]
    return out.transpose(0, 1)


def document_attention(q, k, v, packing, causal: bool, window, scale: float, sink=None) -> torch.Tensor:
    """Each document of ``packing`` over itself, on the padded packed ``[t, h, d]``; padding rows 0."""
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    for start, n in zip(packing.cu_seqlens_padded, packing.lengths):
        rows = torch.arange(start, start + n)
        pos = torch.arange(n)  # document-relative positions
        doc, _ = attention(q[rows][None], k[rows][None], v[rows][None], scale, visible(pos, pos, causal, window), sink)
        out = out.index_put((rows,), doc[0])
    return out
