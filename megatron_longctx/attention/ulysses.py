"""Ulysses attention: all-to-all from sequence shards to head shards, local attention, and back.

DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509; Megatron/TE ``cp_comm_type="a2a"``).
Each rank trades its ``s/P`` tokens of all heads for all ``s`` tokens of ``h/P`` heads, runs one
local attention over the whole sequence (put back in natural order, so it is a single causal
call; the one-rank ring of :func:`.ring.local_schedule`), and trades back.  Q, K and V travel in
one all-to-all.  With a ring group the same code runs the hybrid of :mod:`.hybrid`.

GQA/MQA with fewer K/V heads than ranks: K/V heads are replicated (``repeat_interleave`` by the
smallest factor ``f`` dividing ``h_q/h_kv`` with ``h_kv*f`` divisible by ``P``), so that every rank
receives whole query groups with their K/V head; the gradients of the copies are summed.
Layout inside: ``[b, s, h, d]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.distributed as dist

from .comm import all_to_all
from .ring import RingSchedule, local_schedule, ring_backward, ring_forward, ring_schedule
from .sharding import SeqLayout, natural_to_ranks, ranks_to_natural

if TYPE_CHECKING:
    from .api import AttentionArgs


def kv_replication(hq: int, hkv: int, size: int) -> int:
    """Smallest ``f`` dividing ``hq/hkv`` with ``hkv*f`` divisible by ``size`` (needs ``hq % size == 0``)."""
    if hq % size != 0:
        raise ValueError(
            f"Ulysses needs the query heads ({hq}) divisible by the all-to-all group size ({size}); "
            f"use algorithm='ring', or algorithm='hybrid' with a ulysses_size that divides {hq}"
        )
    group = hq // hkv
    return next(f for f in range(1, group + 1) if group % f == 0 and (hkv * f) % size == 0)


def replicate_kv(x: torch.Tensor, f: int) -> torch.Tensor:
    """``[b, s, h_kv, d]`` -> ``[b, s, h_kv*f, d]``, each head repeated ``f`` times in place."""
    return x if f == 1 else x.repeat_interleave(f, dim=2)


def reduce_replicas(dx: torch.Tensor, f: int) -> torch.Tensor:
    """Sum the gradients of replicated heads: ``[b, s, h_kv*f, d]`` -> ``[b, s, h_kv, d]``."""
    if f == 1:
        return dx
    acc = torch.promote_types(dx.dtype, torch.float32)
    return dx.unflatten(2, (dx.shape[2] // f, f)).sum(3, dtype=acc).to(dx.dtype)  # [b, s, h_kv, d]


def _columns(buf: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """Split ``[P, sum(sizes)]`` into column blocks ``[P, n]`` (views)."""
    return list(buf.split(list(sizes), dim=1))


def _from_ranks(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """``[P, b, s/P, *rest]`` (one shard per rank) -> ``[b, s, *rest]`` in natural (or ``order``'s) order."""
    if order is None:
        return ranks_to_natural(x)
    p, b, s_local = x.shape[:3]
    pooled = x.transpose(0, 1).reshape(b, p * s_local, *x.shape[3:])  # [b, s, *rest], rank-major
    return pooled.index_select(1, order)


def _to_ranks(y: torch.Tensor, p: int, order: torch.Tensor | None) -> torch.Tensor:
    """Inverse of :func:`_from_ranks`: ``[b, s, *rest]`` -> ``[P, b, s/P, *rest]``."""
    if order is None:
        return natural_to_ranks(y, p)
    pooled = torch.empty_like(y).index_copy_(1, order, y)  # [b, s, *rest], rank-major
    return pooled.unflatten(1, (p, y.shape[1] // p)).transpose(0, 1)  # [P, b, s/P, *rest]


def seq_to_heads(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, order: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Each ``[b, s/P, h, d]`` (this rank's zigzag shard) -> ``[b, s, h/P, d]``.

    The result holds head group ``rank`` for the whole sequence, in natural order.  One all-to-all
    carries all tensors (same dtype).  ``order``: an index ``[s]`` into the shards concatenated in
    rank order, used instead of the zigzag-to-natural reordering (packed documents,
    :func:`.packed_layout.group_order`).
    """
    p = dist.get_world_size(group)
    if p == 1:
        return list(tensors)
    shapes = [(p, t.shape[0], t.shape[1], t.shape[2] // p, t.shape[3]) for t in tensors]
    sizes = [t.numel() // p for t in tensors]
    send = torch.empty(p, sum(sizes), dtype=tensors[0].dtype, device=tensors[0].device)  # [P, n]
    for t, shape, block in zip(tensors, shapes, _columns(send, sizes)):
        _, b, s_local, hh, d = shape
        # [b, s/P, h, d] -> [P (head group), b, s/P, h/P, d]
        block.view(shape).copy_(t.view(b, s_local, p, hh, d).permute(2, 0, 1, 3, 4))
    recv = all_to_all(send, group)  # [P (source rank), n]
    # [P (source rank), b, s/P, h/P, d] -> [b, s, h/P, d]
    return [_from_ranks(block.view(shape), order) for shape, block in zip(shapes, _columns(recv, sizes))]


def heads_to_seq(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, order: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Inverse of :func:`seq_to_heads` (same ``order``): each ``[b, s, h/P, d]`` -> ``[b, s/P, h, d]``."""
    p = dist.get_world_size(group)
    if p == 1:
        return list(tensors)
    shapes = [(p, t.shape[0], t.shape[1] // p, t.shape[2], t.shape[3]) for t in tensors]
    sizes = [t.numel() // p for t in tensors]
    send = torch.empty(p, sum(sizes), dtype=tensors[0].dtype, device=tensors[0].device)  # [P, n]
    for t, shape, block in zip(tensors, shapes, _columns(send, sizes)):
        block.view(shape).copy_(_to_ranks(t, p, order))  # [P (destination rank), b, s/P, h/P, d]
    recv = all_to_all(send, group)  # [P (head group), n]
    outs = []
    for shape, block in zip(shapes, _columns(recv, sizes)):
        _, b, s_local, hh, d = shape
        # [P (head group), b, s/P, h/P, d] -> [b, s/P, h, d]
        outs.append(block.view(shape).permute(1, 2, 0, 3, 4).reshape(b, s_local, p * hh, d))
    return outs


def _inner_schedule(ring_group: dist.ProcessGroup | None, seq_len: int, mask) -> RingSchedule:
    """What each rank attends once heads are spread: the whole sequence (Ulysses) or, with a ring
    group, its zigzag shard of ``seq_len`` tokens against every other group's (hybrid)."""
    if ring_group is None or dist.get_world_size(ring_group) == 1:
        return local_schedule(seq_len, mask)
    return ring_schedule(SeqLayout(cp_size=dist.get_world_size(ring_group), chunk=seq_len // 2), mask)


def ulysses_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a2a_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup | None,
    args: AttentionArgs,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """q ``[b, s/P, h_q, d_qk]``, k/v ``[b, s/P, h_kv, d]`` (zigzag shards) -> out ``[b, s/P, h_q, d_v]``
    and what backward needs: the head-sharded q, k, v ``[b, U*s/P, h/U, d]``, their out and lse.

    ``U`` = size of ``a2a_group``.  ``ring_group`` None: Ulysses (``U = P``, local attention over
    the whole sequence).  Otherwise the hybrid of :mod:`.hybrid`: a ring across the groups.
    """
    f = kv_replication(q.shape[2], k.shape[2], dist.get_world_size(a2a_group))
    q_h, k_h, v_h = seq_to_heads([q, replicate_kv(k, f), replicate_kv(v, f)], a2a_group)  # [b, U*s/P, h/U, d]
    schedule = _inner_schedule(ring_group, q_h.shape[1], args.mask)
    out_h, lse = ring_forward(q_h, k_h, v_h, ring_group, schedule, args)  # [b, U*s/P, h_q/U, d_v]
    (out,) = heads_to_seq([out_h], a2a_group)  # [b, s/P, h_q, d_v]
    return out, (q_h, k_h, v_h, out_h, lse)


def ulysses_backward(
    dout: torch.Tensor,
    saved: Sequence[torch.Tensor],
    a2a_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup | None,
    args: AttentionArgs,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`ulysses_forward`; ``dout`` ``[b, s/P, h_q, d_v]``; ``kv_heads``: h_kv before
    replication."""
    q_h, k_h, v_h, out_h, lse = saved
    schedule = _inner_schedule(ring_group, q_h.shape[1], args.mask)
    (dout_h,) = seq_to_heads([dout], a2a_group)  # [b, U*s/P, h_q/U, d_v]
    dq_h, dk_h, dv_h = ring_backward(dout_h, q_h, k_h, v_h, out_h, lse, ring_group, schedule, args)
    dq, dk, dv = heads_to_seq([dq_h, dk_h, dv_h], a2a_group)  # [b, s/P, h, d]
    f = dk.shape[2] // kv_heads
    return dq, reduce_replicas(dk, f), reduce_replicas(dv, f)


class UlyssesAttention(torch.autograd.Function):
    """Autograd wrapper of :func:`ulysses_forward` / :func:`ulysses_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, a2a_group, ring_group, args):
        out, saved = ulysses_forward(q.contiguous(), k.contiguous(), v.contiguous(), a2a_group, ring_group, args)
        ctx.save_for_backward(*saved)
        ctx.groups, ctx.args, ctx.kv_heads = (a2a_group, ring_group), args, k.shape[2]
        return out

    @staticmethod
    def backward(ctx, dout):
        dq, dk, dv = ulysses_backward(dout.contiguous(), ctx.saved_tensors, *ctx.groups, ctx.args, ctx.kv_heads)
        return dq, dk, dv, None, None, None
