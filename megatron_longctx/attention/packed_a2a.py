"""Packed (THD) attention as all-to-all inside groups of ``U`` ranks, then a ring across the groups.

One pattern serves three algorithms on per-document zigzag shards (:mod:`.packed_layout`):
``U = 1`` is the ring (Ring Attention, Liu et al. 2023), ``U = cp`` is Ulysses (DeepSpeed-Ulysses,
Jacobs et al. 2023, arXiv:2309.14509) whose "ring" is a single local step, and anything between is
the hybrid (USP, Fang & Zhao 2024, arXiv:2405.07719; LoongTrain, Gu et al. 2024).

The all-to-all of :mod:`.ulysses` trades heads for tokens inside the group.  The pooled tokens of ranks
``gU .. gU+U-1`` are, per document, chunks ``g`` and ``2cp/U-1-g`` of a ``U`` times coarser split
(:meth:`.packed_layout.PackedLayout.coarsen`), after one fixed reordering
(:func:`.packed_layout.group_order`): so the ring of :mod:`.ring` runs unchanged on the coarse
layout, fed by the per-document schedule of :func:`.packed_plan.packed_ring_schedule` (a ring of one
rank, ``group=None``, is local attention).  GQA/MQA K/V heads are replicated as in :mod:`.ulysses`.
Layout ``[b, t, h, d]``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from .packed_layout import PackedLayout, group_order
from .packed_plan import packed_ring_schedule
from .ring import ring_backward, ring_forward
from .ulysses import heads_to_seq, kv_replication, reduce_replicas, replicate_kv, seq_to_heads

if TYPE_CHECKING:
    from .api import AttentionArgs


@dataclasses.dataclass(frozen=True)
class PackedA2APlan:
    """Non-tensor arguments: the per-rank layout, the all-to-all group size and the attention args."""

    layout: PackedLayout  # over all cp ranks
    a2a_size: int  # U: 1 = plain ring, cp = Ulysses
    args: AttentionArgs


def packed_a2a_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a2a_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    plan: PackedA2APlan,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """q ``[b, t, h_q, d_qk]``, k/v ``[b, t, h_kv, d]`` (this rank's packed shard) -> out ``[b, t, h_q, d_v]``
    and what backward needs (the coarse q, k, v, their out and lse)."""
    u = plan.a2a_size
    schedule = packed_ring_schedule(plan.layout.coarsen(u), plan.args.mask)
    if u > 1:
        f = kv_replication(q.shape[2], k.shape[2], u)
        order = group_order(plan.layout, u, q.device)
        q, k, v = seq_to_heads([q, replicate_kv(k, f), replicate_kv(v, f)], a2a_group, order)  # [b, U*t, h/U, d]
    out_h, lse = ring_forward(q, k, v, ring_group, schedule, plan.args)  # [b, U*t, h_q/U, d_v]
    out = out_h
    if u > 1:
        (out,) = heads_to_seq([out_h], a2a_group, order)  # [b, t, h_q, d_v]
    return out, (q, k, v, out_h, lse)


def packed_a2a_backward(
    dout: torch.Tensor,
    saved: Sequence[torch.Tensor],
    a2a_group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None,
    plan: PackedA2APlan,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`packed_a2a_forward`; ``kv_heads`` = h_kv before replication."""
    q_h, k_h, v_h, out_h, lse = saved
    u = plan.a2a_size
    schedule = packed_ring_schedule(plan.layout.coarsen(u), plan.args.mask)
    if u == 1:
        return ring_backward(dout, q_h, k_h, v_h, out_h, lse, ring_group, schedule, plan.args)
    order = group_order(plan.layout, u, dout.device)
    (dout_h,) = seq_to_heads([dout], a2a_group, order)  # [b, U*t, h_q/U, d_v]
    dq_h, dk_h, dv_h = ring_backward(dout_h, q_h, k_h, v_h, out_h, lse, ring_group, schedule, plan.args)
    dq, dk, dv = heads_to_seq([dq_h, dk_h, dv_h], a2a_group, order)  # [b, t, h, d]
    f = dk.shape[2] // kv_heads
    return dq, reduce_replicas(dk, f), reduce_replicas(dv, f)


class PackedA2AAttention(torch.autograd.Function):
    """Autograd wrapper of :func:`packed_a2a_forward` / :func:`packed_a2a_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, a2a_group, ring_group, plan):
        out, saved = packed_a2a_forward(q.contiguous(), k.contiguous(), v.contiguous(), a2a_group, ring_group, plan)
        ctx.save_for_backward(*saved)
        ctx.groups, ctx.plan, ctx.kv_heads = (a2a_group, ring_group), plan, k.shape[2]
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = packed_a2a_backward(dout.contiguous(), ctx.saved_tensors, *ctx.groups, ctx.plan, ctx.kv_heads)
        return dq, dk, dv, None, None, None
