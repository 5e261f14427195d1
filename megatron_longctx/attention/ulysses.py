"""All-to-all inside groups of ``U`` ranks, then a ring across the groups: Ulysses and the hybrid.

:func:`ulysses_attention` trades each rank's tokens of all heads for its group's tokens of ``h/U`` heads
(:func:`seq_to_heads`), attends, and trades back (:func:`heads_to_seq`).  Ulysses is ``U = cp``: one local
attention (:class:`HeadsAttention`, a ring of one rank).  The hybrid is ``1 < U < cp``: after the
all-to-all the pooled tokens of ranks ``gU .. gU+U-1`` are, per document, chunks ``g`` and ``2cp/U-1-g`` of
a ``U`` times coarser split (:meth:`.layout.SeqLayout.coarsen`, reordered by :func:`.layout.from_ranks`), so
the ring of :mod:`.ring` runs unchanged on the coarse layout across the groups.  Dense and packed sequences
take the same path (a dense sequence is one document).  K/V heads fewer than ranks are replicated
(:func:`.args.kv_replication`).  Layout inside: ``[b, t, h, d]``.
The papers, the memory of the all-to-alls and the GQA rule: docs/attention.md.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .args import AttentionArgs, kv_replication
from .block_loop import Rows, attend_local_backward
from .comm import all_to_all, all_to_all_rows
from .layout import SeqLayout, from_ranks, pooled_index, to_ranks
from .ring import RingAttention
from .schedule import ring_schedule
from .sinks import heads_of, sink_grad

# The local attention's backward runs over at most this many head pieces (see :func:`head_pieces`).
MAX_HEAD_PIECES = 4
# Local tokens up to which q, k, v travel in one all-to-all (and their gradients in one), each all-to-all a
# single collective: a collective's fixed cost outweighs the buffers of so few tokens.
PACK_MAX_TOKENS = 1024


def replicate_kv(x: torch.Tensor, f: int) -> torch.Tensor:
    """``[b, t, h_kv, d]`` -> ``[b, t, h_kv*f, d]``, each head repeated ``f`` times in place."""
    return x if f == 1 else x.repeat_interleave(f, dim=2)


def reduce_replicas(dx: torch.Tensor, f: int) -> torch.Tensor:
    """Sum the gradients of replicated heads: ``[b, t, h_kv*f, d]`` -> ``[b, t, h_kv, d]``."""
    if f == 1:
        return dx
    acc = torch.promote_types(dx.dtype, torch.float32)
    return dx.unflatten(2, (dx.shape[2] // f, f)).sum(3, dtype=acc).to(dx.dtype)  # [b, t, h_kv, d]


def in_halves(layout: SeqLayout, x: torch.Tensor) -> bool:
    """Whether the all-to-alls of ``x`` ``[b, t, h, d]`` can land in their final place: one document and
    one batch row.  A rank's shard is then its two chunks, and the coarse shard of its group is the
    members' first chunks in rank order followed by their second chunks in reverse rank order."""
    return layout.num_docs == 1 and x.shape[0] == 1


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, index, halves: bool = False) -> torch.Tensor:
    """``[b, t, h, d]`` (this rank's shard) -> ``[b, U*t, h/U, d]``: head group ``rank`` of the coarse shard.

    ``index``: :func:`.layout.pooled_index` of the layout for ``U`` = size of ``group`` (unused, and
    may be None, with ``halves``).  ``halves`` (:func:`in_halves`): each chunk travels in its own
    all-to-all straight into the result, which then needs no reordered copy: the first chunks with
    one all-to-all in rank order, the second chunks row by row into their slots in reverse rank
    order (:func:`.comm.all_to_all_rows`).
    """
    u = dist.get_world_size(group)
    b, t, h, d = x.shape
    if halves:
        c = t // 2
        out = x.new_empty(b, u * t, h // u, d)  # [1, U*t, h/U, d]: 2U chunks of c tokens
        for i in range(2):
            send = x[:, i * c:(i + 1) * c].reshape(b, c, u, h // u, d).permute(2, 0, 1, 3, 4).contiguous()
            slots = out[:, i * u * c:(i + 1) * u * c].view(u, -1)  # [U, c*h/U*d]
            if i == 0:
                all_to_all(send.view(u, -1), group, out=slots)  # member m's first chunk -> slot m
            else:
                # member m's second chunk -> slot U-1-m
                all_to_all_rows(send.view(u, -1).unbind(0), slots.unbind(0)[::-1], group)
            del send  # [U (head group), b, c, h/U, d]
        return out
    send = x.view(b, t, u, h // u, d).permute(2, 0, 1, 3, 4).contiguous()  # [U (head group), b, t, h/U, d]
    recv = all_to_all(send.view(u, -1), group).view(u, b, t, h // u, d)  # [U (source rank), b, t, h/U, d]
    del send
    return from_ranks(recv, index)  # [b, U*t, h/U, d]


def heads_to_seq(y: torch.Tensor, group: dist.ProcessGroup, index, halves: bool = False) -> torch.Tensor:
    """Inverse of :func:`seq_to_heads` (same ``index`` and ``halves``): ``[b, U*t, h/U, d]`` -> ``[b, t, h, d]``."""
    u = dist.get_world_size(group)
    if halves:
        b, ut, hh, d = y.shape
        c = ut // u // 2
        out = y.new_empty(b, 2 * c, u, hh, d)  # [1, t, U (head group), h/U, d]
        for i in range(2):
            chunks = y[:, i * u * c:(i + 1) * u * c].view(u, -1)  # [U (slot), c*h/U*d]
            if i == 0:
                recv = all_to_all(chunks, group)  # slot m holds member m's first chunk
            else:
                recv = torch.empty_like(chunks)
                all_to_all_rows(chunks.unbind(0)[::-1], recv.unbind(0), group)  # slot U-1-m: member m's 2nd chunk
            out[:, i * c:(i + 1) * c] = recv.view(u, b, c, hh, d).permute(1, 2, 0, 3, 4)  # [1, c, U, h/U, d]
            del recv  # [U (head group), b*c*h/U*d]
        return out.view(b, 2 * c, u * hh, d)  # [b, t, h, d]
    send = to_ranks(y, u, index)  # [U (destination rank), b, t, h/U, d]
    _, b, t, hh, d = send.shape
    recv = all_to_all(send.view(u, -1), group).view(u, b, t, hh, d)  # [U (head group), b, t, h/U, d]
    del send
    return recv.permute(1, 2, 0, 3, 4).reshape(b, t, u * hh, d)  # [b, t, h, d]


def _columns(buf: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of ``buf`` ``[U, sum n_i]`` as ``[U, *shape_i[1:]]`` each, side by side along its columns."""
    views, offset = [], 0
    for shape in shapes:
        n = math.prod(shape[1:])
        views.append(buf[:, offset:offset + n].view(shape))
        offset += n
    return views


def seq_to_heads_packed(xs: list[torch.Tensor], group: dist.ProcessGroup, index) -> list[torch.Tensor]:
    """:func:`seq_to_heads` of several tensors ``[b, t, h_i, d_i]`` (this rank's shards, one dtype) in one
    all-to-all: one send buffer ``[U, sum n_i]``, its receive buffer, then one reordering gather each ->
    ``[b, U*t, h_i/U, d_i]``."""
    u = dist.get_world_size(group)
    per_group = [x.view(x.shape[0], x.shape[1], u, x.shape[2] // u, x.shape[3]).permute(2, 0, 1, 3, 4)
                 for x in xs]  # [U (head group), b, t, h_i/U, d_i] views
    shapes = [tuple(x.shape) for x in per_group]
    send = xs[0].new_empty(u, sum(math.prod(shape[1:]) for shape in shapes))  # [U, sum n_i]
    for column, x in zip(_columns(send, shapes), per_group):
        column.copy_(x)
    recv = all_to_all(send, group)  # [U (source rank), sum n_i]
    del send
    return [from_ranks(column, index) for column in _columns(recv, shapes)]  # [b, U*t, h_i/U, d_i] each


def heads_to_seq_packed(ys: list[torch.Tensor], group: dist.ProcessGroup, index) -> list[torch.Tensor]:
    """Inverse of :func:`seq_to_heads_packed` (same ``index``): ``[b, U*t, h_i/U, d_i]`` each -> ``[b, t, h_i, d_i]``."""
    u = dist.get_world_size(group)
    shapes = [(u, y.shape[0], y.shape[1] // u, *y.shape[2:]) for y in ys]  # [U, b, t, h_i/U, d_i]
    send = ys[0].new_empty(u, sum(math.prod(shape[1:]) for shape in shapes))  # [U (destination rank), sum n_i]
    for column, y in zip(_columns(send, shapes), ys):
        to_ranks(y, u, index, out=column)
    recv = all_to_all(send, group)  # [U (head group), sum n_i]
    del send
    return [column.permute(1, 2, 0, 3, 4).reshape(b, t, u * hh, d)  # [b, t, h_i, d_i]
            for column, (_, b, t, hh, d) in zip(_columns(recv, shapes), shapes)]


class _QKVToHeads(torch.autograd.Function):
    """:func:`seq_to_heads_packed` of q, k, v (K/V heads replicated ``f`` times), their gradients back in one
    :func:`heads_to_seq_packed`; saves nothing."""

    @staticmethod
    def forward(ctx, q, k, v, group, index, f):
        ctx.group, ctx.index, ctx.f = group, index, f
        kv = [replicate_kv(x.contiguous(), f) for x in (k, v)]
        return tuple(seq_to_heads_packed([q.contiguous(), *kv], group, index))

    @staticmethod
    def backward(ctx, dq_h, dk_h, dv_h):
        dq, dk, dv = heads_to_seq_packed([g.contiguous() for g in (dq_h, dk_h, dv_h)], ctx.group, ctx.index)
        return dq, reduce_replicas(dk, ctx.f), reduce_replicas(dv, ctx.f), None, None, None


class _SeqToHeads(torch.autograd.Function):
    """:func:`seq_to_heads` (after replicating K/V heads ``f`` times) as an autograd node; saves nothing."""

    @staticmethod
    def forward(ctx, x, group, index, halves, f):
        ctx.group, ctx.index, ctx.halves, ctx.f = group, index, halves, f
        return seq_to_heads(replicate_kv(x.contiguous(), f), group, index, halves)

    @staticmethod
    def backward(ctx, dx_h):
        dx = heads_to_seq(dx_h.contiguous(), ctx.group, ctx.index, ctx.halves)
        return reduce_replicas(dx, ctx.f), None, None, None, None


class _HeadsToSeq(torch.autograd.Function):
    """:func:`heads_to_seq` as an autograd node; saves nothing."""

    @staticmethod
    def forward(ctx, y, group, index, halves):
        ctx.group, ctx.index, ctx.halves = group, index, halves
        return heads_to_seq(y.contiguous(), group, index, halves)

    @staticmethod
    def backward(ctx, dy):
        return seq_to_heads(dy.contiguous(), ctx.group, ctx.index, ctx.halves), None, None, None


def head_pieces(h_q: int, h_kv: int, max_pieces: int = MAX_HEAD_PIECES) -> list[tuple[slice, slice]]:
    """(query heads, K/V heads) of each backward call of :class:`HeadsAttention`: up to ``max_pieces``
    runs of whole K/V heads with their query groups, so the pieces' gradients are disjoint.  One K/V
    head is one piece: splitting its query group would hold dK/dV sums beside the pieces' gradients,
    about what the split saves."""
    g, n = h_q // h_kv, min(h_kv, max_pieces)
    edges = [h_kv * i // n for i in range(n + 1)]
    return [(slice(a * g, b * g), slice(a, b)) for a, b in zip(edges, edges[1:])]


class HeadsAttention(RingAttention):
    """Ulysses' local attention over all tokens of this rank's heads: :class:`.ring.RingAttention` over a
    ring of one rank (``group`` None), with its own backward.

    The backward runs one call per :func:`head_pieces` piece and writes its dq, dk and dv over the saved
    q, k and v heads of that piece, which no later piece reads; the gradients returned are those
    buffers.  Only for inputs that nothing else holds (the all-to-alls' results): the in-place writes
    bump their version, so a second backward through a retained graph fails loudly instead of reading
    gradients as inputs.
    """

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout, calls = dout.contiguous(), ctx.plan.calls[0][0]
        scale, backend = ctx.args.softmax_scale, ctx.args.backend
        dsink = sink_grad(dout, out, lse, sink) if any(ctx.needs_input_grad[6:]) else None
        pieces = head_pieces(q.shape[2], k.shape[2])
        if len(pieces) == 1:
            return (*attend_local_backward(Rows(q, out, lse, dout), k, v, calls, scale, backend), None, None, None,
                    dsink)
        grads = q.detach(), k.detach(), v.detach()  # written over, piece by piece
        # The kernels take dout contiguous (the CPU op copies a strided one on every call): each piece's
        # is copied into one buffer, the size of the widest piece.
        flat = dout.new_empty(dout[:, :, :max(hq.stop - hq.start for hq, _ in pieces)].numel())
        for hq, hk in pieces:
            strided = dout[:, :, hq]
            dout_p = flat[:strided.numel()].view(strided.shape).copy_(strided)
            rows = Rows(q[:, :, hq], out[:, :, hq], lse[:, hq], dout_p)
            piece = attend_local_backward(rows, k[:, :, hk], v[:, :, hk], calls, scale, backend)
            for grad, heads, g in zip(grads, (hq, hk, hk), piece):
                grad[:, :, heads] = g
            del piece
        return (*grads, None, None, None, dsink)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a2a_group: dist.ProcessGroup,
    ring_group: dist.ProcessGroup | None,
    layout: SeqLayout,
    args: AttentionArgs,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """q ``[b, t, h_q, d_qk]``, k/v ``[b, t, h_kv, d]`` (this rank's shard of ``layout``) -> out
    ``[b, t, h_q, d_v]``.  ``ring_group`` None: Ulysses (``U = cp``, one local attention).  ``sink``
    ``[h_q]`` or None (:mod:`.sinks`): each rank applies the sinks of the heads it attends, so its
    gradient holds those heads' share over the tokens of its ring.

    Three autograd nodes, as DeepSpeed's ``DistributedAttention`` has them: the all-to-alls in (one for
    q, k and v together up to :data:`PACK_MAX_TOKENS` local tokens), the ring over the head-sharded
    tensors (:class:`.ring.RingAttention`, or :class:`HeadsAttention` for Ulysses; the only node that
    saves anything), the all-to-all out.  In backward the engine frees the saved head-sharded tensors
    as soon as the ring's gradients exist, before those travel back (Ulysses' gradients are its saved
    q, k, v, written over).
    """
    u = dist.get_world_size(a2a_group)
    short = q.shape[1] <= PACK_MAX_TOKENS
    schedule, halves = ring_schedule(layout.coarsen(u), args.mask), in_halves(layout, q) and not short
    index = None if halves else pooled_index(layout, u, q.device)  # the in-place halves need no index
    f = kv_replication(q.shape[2], k.shape[2], u)
    if short:  # [b, U*t, h_q/U, d_qk], [b, U*t, h_kv*f/U, d_qk], [b, U*t, h_kv*f/U, d_v] in one all-to-all
        q_h, k_h, v_h = _QKVToHeads.apply(q, k, v, a2a_group, index, f)
    else:
        q_h = _SeqToHeads.apply(q, a2a_group, index, halves, 1)  # [b, U*t, h_q/U, d_qk]
        k_h = _SeqToHeads.apply(k, a2a_group, index, halves, f)  # [b, U*t, h_kv*f/U, d_qk]
        v_h = _SeqToHeads.apply(v, a2a_group, index, halves, f)  # [b, U*t, h_kv*f/U, d_v]
    sink_h = heads_of(sink, dist.get_rank(a2a_group), u)  # [h_q/U] or None
    if ring_group is None:
        out_h = HeadsAttention.apply(q_h, k_h, v_h, None, schedule, args, sink_h)  # [b, U*t, h_q/U, d_v]
    else:
        out_h = RingAttention.apply(q_h, k_h, v_h, ring_group, schedule, args, sink_h)
    return _HeadsToSeq.apply(out_h, a2a_group, index, halves)  # [b, t, h_q, d_v]
