"""Attention on one rank (context-parallel size 1), in Megatron's layouts, with PyTorch's SDPA.

The path :class:`~megatron_longctx.megatron.core_attention.ContextParallelAttention` takes when the
sequence is not split: no communication, ``torch.nn.functional.scaled_dot_product_attention``
(FlashAttention-2, Dao 2023, arXiv:2307.08691, on CUDA; fused math on CPU), K/V heads grouped
(GQA) without expanding them, attention dropout supported.  Attention sinks (``softmax_offset``
``[hq]``, Megatron's ``--softmax-type off-by-one|learnable``) take the math path with the sink as one
more column of the scores, as Megatron's ``SoftmaxOne`` does.

No call reads a device tensor back to the host on its own: the packed layout's ``cu_seqlens`` are
copied to the host once (one transfer for all of them) and cached on the tensor objects, which
Megatron shares across the layers of a batch and its recompute; whether a row of a causal/windowed
block sees no key is worked out from the shapes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from megatron_longctx.attention.layout import host_offsets


@dataclasses.dataclass(frozen=True)
class LocalAttentionArgs:
    """Non-tensor arguments of one local attention call."""

    softmax_scale: float
    causal: bool = True
    window_size: tuple[int, int] | None = None  # (left, right), -1 = unbounded (flash-attn convention)
    dropout_p: float = 0.0


def _visible(sq: int, sk: int, args: LocalAttentionArgs, device: torch.device) -> torch.Tensor | None:
    """``[sq, sk]`` bool, True where query i sees key j (bottom-right aligned), or None for all-visible."""
    left, right = args.window_size if args.window_size is not None else (-1, -1)
    if args.causal:
        right = 0
    if left < 0 and right < 0:
        return None
    q_pos = torch.arange(sq, device=device)[:, None] + (sk - sq)
    dist = q_pos - torch.arange(sk, device=device)[None, :]  # [sq, sk]
    visible = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        visible &= dist >= -right
    if left >= 0:
        visible &= dist <= left
    return visible


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: LocalAttentionArgs,
          dense_mask: torch.Tensor | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """q ``[b, hq, sq, d]``, k ``[b, hkv, sk, d]``, v ``[b, hkv, sk, dv]`` -> ``[b, hq, sq, dv]``."""
    sq, sk = q.shape[2], k.shape[2]
    if sink is not None:
        visible = _visible(sq, sk, args, q.device)
        if dense_mask is not None:
            visible = dense_mask if visible is None else visible & dense_mask
        groups = q.shape[1] // k.shape[1]
        # [b, hkv, sk, d] -> [b, hq, sk, d]
        return _math(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), args, visible, sink)
    if args.causal and args.window_size is None and sq == sk and dense_mask is None:
        # Plain causal: SDPA's own is_causal, no [sq, sk] mask materialised.
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=args.dropout_p, is_causal=True, scale=args.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # [b, hq, sq, dv]
    visible = _visible(sq, sk, args, q.device)
    if dense_mask is not None:
        visible = dense_mask if visible is None else visible & dense_mask
    # a user's dense mask must be read back to know; the window alone is known on the host
    empty_rows = bool((~visible.any(-1)).any()) if dense_mask is not None else _empty_rows(sq, sk, args)
    if visible is not None and empty_rows:
        # Rows that see nothing give NaN in SDPA; do it by hand so they give 0 like the kernels do.
        groups = q.shape[1] // k.shape[1]
        # [b, hkv, sk, d] -> [b, hq, sk, d]
        return _math(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), args, visible)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=visible, dropout_p=args.dropout_p, scale=args.softmax_scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # [b, hq, sq, dv]; K/V heads grouped, not expanded


def _empty_rows(sq: int, sk: int, args: LocalAttentionArgs) -> bool:
    """Whether some query row of the bottom-right aligned causal/window mask sees no key (host only)."""
    left, right = args.window_size if args.window_size is not None else (-1, -1)
    if args.causal:
        right = 0
    shift = sk - sq  # query i sits at key position i + shift
    first_hi = shift + right if right >= 0 else sk  # the last key row 0 may see
    last_lo = sq - 1 + shift - left if left >= 0 else -1  # the first key the last row may see
    return first_hi < 0 or last_lo > sk - 1


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: LocalAttentionArgs,
          visible: torch.Tensor | None, sink: torch.Tensor | None = None) -> torch.Tensor:
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * args.softmax_scale  # [b, h, sq, sk]
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    scores = scores.float() if q.dtype != torch.float64 else scores
    if sink is not None:  # [b, h, sq, sk] -> [b, h, sq, sk + 1]: the sink's logit last, dropped after the softmax
        column = sink.to(scores.dtype).view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)
    probs = F.dropout(probs, p=args.dropout_p, training=args.dropout_p > 0)
    return torch.einsum("bhqk,bhkd->bhqd", probs, v)  # [b, h, sq, dv]


def local_attention_sbhd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: LocalAttentionArgs,
                         dense_mask: torch.Tensor | None = None, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Megatron layout: q ``[sq, b, hq, d]``, k ``[sk, b, hkv, d]``, v ``[sk, b, hkv, dv]`` -> ``[sq, b, hq, dv]``.

    ``dense_mask``: optional bool ``[sq, sk]`` or broadcastable ``[b, 1, sq, sk]``, True = visible.
    ``sink``: optional ``[hq]`` attention sinks (one more logit per head in each row's softmax).
    """
    out = _sdpa(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), args, dense_mask, sink)
    return out.permute(2, 0, 1, 3)  # [b, hq, sq, dv] -> [sq, b, hq, dv]


def local_attention_thd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: LocalAttentionArgs,
                        cu_seqlens_q: torch.Tensor, cu_seqlens_kv: torch.Tensor,
                        cu_seqlens_q_padded: torch.Tensor | None = None,
                        cu_seqlens_kv_padded: torch.Tensor | None = None,
                        sink: torch.Tensor | None = None) -> torch.Tensor:
    """Packed (THD) layout: q ``[t, hq, d]``, k ``[t, hkv, d]``, v ``[t, hkv, dv]`` -> ``[t, hq, dv]``.

    Document ``i`` has ``cu_seqlens[i+1] - cu_seqlens[i]`` tokens starting at ``cu_seqlens_padded[i]``
    (``cu_seqlens`` itself when no padded offsets are given); it attends only to itself.  Padding
    tokens between documents get a zero output.
    """
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])  # [t, hq, dv]
    cu_q, cu_k, starts_q, starts_k = host_offsets(
        cu_seqlens_q, cu_seqlens_kv,
        cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q,
        cu_seqlens_kv_padded if cu_seqlens_kv_padded is not None else cu_seqlens_kv)
    lens_q = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    pieces, rows = [], []
    for sq0, lq, sk0, lk in zip(starts_q, lens_q, starts_k, lens_k):
        if lq == 0:
            continue
        qd = q[sq0 : sq0 + lq].unsqueeze(1)  # [lq, 1, hq, d]
        kd, vd = k[sk0 : sk0 + lk].unsqueeze(1), v[sk0 : sk0 + lk].unsqueeze(1)  # [lk, 1, hkv, d]
        pieces.append(local_attention_sbhd(qd, kd, vd, args, sink=sink).squeeze(1))  # [lq, hq, dv]
        rows.append(torch.arange(sq0, sq0 + lq, device=q.device))
    if not pieces:
        return out
    return out.index_put((torch.cat(rows),), torch.cat(pieces))
