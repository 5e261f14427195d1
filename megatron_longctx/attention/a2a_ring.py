"""All-to-all inside groups of ``U`` ranks, then a ring across the groups: Ulysses and the hybrid.

DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509; Megatron/TE ``cp_comm_type="a2a"``) is
``U = cp``: each rank trades its ``s/P`` tokens of all heads for all ``s`` tokens of ``h/P`` heads,
runs one local attention (a ring of one rank) and trades back.  The hybrid (USP, Fang & Zhao 2024,
arXiv:2405.07719; LoongTrain, Gu et al. 2024; ``cp_comm_type="a2a+p2p"``, groups of
:mod:`.hybrid_groups`) is ``1 < U < cp``: after the all-to-all the pooled tokens of ranks ``gU ..
gU+U-1`` are, per document, chunks ``g`` and ``2cp/U-1-g`` of a ``U`` times coarser split
(:meth:`.layout.SeqLayout.coarsen`, reordered by :func:`.layout.from_ranks`), so the ring of
:mod:`.ring` runs unchanged on the coarse layout across the groups.  Dense and packed sequences
take the same path (a dense sequence is one document).

Memory: q, k, v (and the gradients in backward) each travel in their own all-to-all, as
DeepSpeed's ``DistributedAttention`` does, so at most one tensor's send buffer, receive buffer and
reordered copy are alive at a time, not three of each.

GQA/MQA with fewer K/V heads than ranks: K/V heads are replicated (``repeat_interleave`` by the
smallest factor ``f`` dividing ``h_q/h_kv`` with ``h_kv*f`` divisible by ``U``,
:func:`.args.kv_replication`), so that every rank receives whole query groups with their K/V head;
the gradients of the copies are summed.  Layout inside: ``[b, t, h, d]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .args import AttentionArgs, kv_replication
from .comm import all_to_all
from .layout import SeqLayout, from_ranks, pooled_index, to_ranks
from .ring import ring_backward, ring_forward
from .schedule import RingSchedule, ring_schedule


def replicate_kv(x: torch.Tensor, f: int) -> torch.Tensor:
    """``[b, t, h_kv, d]`` -> ``[b, t, h_kv*f, d]``, each head repeated ``f`` times in place."""
    return x if f == 1 else x.repeat_interleave(f, dim=2)


def reduce_replicas(dx: torch.Tensor, f: int) -> torch.Tensor:
    """Sum the gradients of replicated heads: ``[b, t, h_kv*f, d]`` -> ``[b, t, h_kv, d]``."""
    if f == 1:
        return dx
    acc = torch.promote_types(dx.dtype, torch.float32)
    return dx.unflatten(2, (dx.shape[2] // f, f)).sum(3, dtype=acc).to(dx.dtype)  # [b, t, h_kv, d]


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, index) -> torch.Tensor:
    """``[b, t, h, d]`` (this rank's shard) -> ``[b, U*t, h/U, d]``: head group ``rank`` of the coarse shard.

    ``index``: :func:`.layout.pooled_index` of the layout for ``U`` = size of ``group``.
    """
    u = dist.get_world_size(group)
    b, t, h, d = x.shape
    send = x.view(b, t, u, h // u, d).permute(2, 0, 1, 3, 4).contiguous()  # [U (head group), b, t, h/U, d]
    recv = all_to_all(send.view(u, -1), group).view(u, b, t, h // u, d)  # [U (source rank), b, t, h/U, d]
    del send
    return from_ranks(recv, index)  # [b, U*t, h/U, d]


def heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup, index) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads` (same ``index``): ``[b, U*t, h/U, d]`` -> ``[b, t, h, d]``."""
    u = dist.get_world_size(group)
    send = to_ranks(y, u, index)  # [U (destination rank), b, t, h/U, d]
    _, b, t, hh, d = send.shape
    recv = all_to_all(send.view(u, -1), group).view(u, b, t, hh, d)  # [U (head group), b, t, h/U, d]
    del send
    return recv.permute(1, 2, 0, 3, 4).reshape(b, t, u * hh, d)  # [b, t, h, d]


def _inner(layout: SeqLayout, u: int, args: AttentionArgs, device) -> tuple[RingSchedule, tuple]:
    """The ring over the coarse layout (one rank for Ulysses) and the reordering index of the all-to-all."""
    return ring_schedule(layout.coarsen(u), args.mask), pooled_index(layout, u, device)


def a2a_ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a2a_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup | None,
    layout: SeqLayout,
    args: AttentionArgs,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """q ``[b, t, h_q, d_qk]``, k/v ``[b, t, h_kv, d]`` (this rank's shard of ``layout``) -> out
    ``[b, t, h_q, d_v]`` and what backward needs: the head-sharded q, k, v ``[b, U*t, h/U, d]``, their
    out and lse.  ``ring_group`` None: Ulysses (``U = cp``, one local attention)."""
    u = dist.get_world_size(a2a_group)
    schedule, index = _inner(layout, u, args, q.device)
    f = kv_replication(q.shape[2], k.shape[2], u)
    q_h = seq_to_heads(q, a2a_group, index)  # [b, U*t, h_q/U, d_qk]
    k_h = seq_to_heads(replicate_kv(k, f), a2a_group, index)  # [b, U*t, h_kv*f/U, d_qk]
    v_h = seq_to_heads(replicate_kv(v, f), a2a_group, index)  # [b, U*t, h_kv*f/U, d_v]
    out_h, lse = ring_forward(q_h, k_h, v_h, ring_group, schedule, args)  # [b, U*t, h_q/U, d_v]
    out = heads_to_seq(out_h, a2a_group, index)  # [b, t, h_q, d_v]
    return out, (q_h, k_h, v_h, out_h, lse)


def a2a_ring_backward(
    dout: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    a2a_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup | None,
    layout: SeqLayout,
    args: AttentionArgs,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`a2a_ring_forward`; ``dout`` ``[b, t, h_q, d_v]``; ``kv_heads``: h_kv before
    replication.  Each head-sharded gradient is freed once it has travelled back."""
    q_h, k_h, v_h, out_h, lse = saved
    u = dist.get_world_size(a2a_group)
    schedule, index = _inner(layout, u, args, dout.device)
    dout_h = seq_to_heads(dout, a2a_group, index)  # [b, U*t, h_q/U, d_v]
    grads = list(ring_backward(dout_h, q_h, k_h, v_h, out_h, lse, ring_group, schedule, args))
    del dout_h
    f = k_h.shape[2] * u // kv_heads
    back = []
    for i in range(3):
        g = heads_to_seq(grads[i], a2a_group, index)  # [b, t, h, d]
        grads[i] = None  # the head-sharded gradient is no longer needed
        back.append(g if i == 0 else reduce_replicas(g, f))
    return back[0], back[1], back[2]


class A2ARingAttention(torch.autograd.Function):
    """Autograd wrapper of :func:`a2a_ring_forward` / :func:`a2a_ring_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, a2a_group, ring_group, layout, args):
        out, saved = a2a_ring_forward(q.contiguous(), k.contiguous(), v.contiguous(), a2a_group, ring_group,
                                      layout, args)
        ctx.save_for_backward(*saved)
        ctx.groups, ctx.layout, ctx.args, ctx.kv_heads = (a2a_group, ring_group), layout, args, k.shape[2]
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = a2a_ring_backward(dout.contiguous(), ctx.saved_tensors, *ctx.groups, ctx.layout, ctx.args,
                                       ctx.kv_heads)
        return dq, dk, dv, None, None, None, None
