"""Ring attention: K/V travel around the context-parallel ranks while each rank keeps its queries.

Ring Attention (Liu, Zaharia & Abbeel 2023) on Megatron's load-balanced layout (the zigzag ring of
ring-flash-attention, Zhu 2024; Megatron/TE ``cp_comm_type="p2p"``).  At step ``i`` rank ``r``
holds the K/V shard of rank ``r - offsets[i]``; the transfer for the next step is posted before the
current block is computed, so communication overlaps compute.  In backward the K/V go round once
more and the dK/dV accumulated for each shard follow it from holder to holder, then return to
their owner.

The schedule is a pure function of the layout and the mask (:func:`.schedule.ring_schedule`, dense
or packed alike): an offset no rank has a visible block at is skipped altogether, and the next
transfer jumps over it.  A ring of one rank is plain local attention (``cp_group`` of size 1, the
inner step of Ulysses): no message is packed and, when one call covers the whole block, its kernel
result is the answer (no accumulator, no merge).  Layout inside: ``[b, s, h, d]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .args import AttentionArgs
from .block_loop import (
    GradSum,
    Rows,
    attend_first,
    attend_local,
    attend_local_backward,
    attend_segments,
    attend_segments_backward,
    attend_whole_backward,
)
from .comm import RingComm, pack, unpack
from .pattern import PatternAttention
from .schedule import RingSchedule
from .segments import split_for_overlap, whole


# Local tokens up to which the ring backward splits its local block around the remote steps
# (:func:`.segments.split_for_overlap`): a small head while the first remote K/V arrive, the rest after the
# last remote step, while the last dK/dV travel home (at P = 2 nothing else hides that return). Longer
# shards run the local block whole, first: the return is a small part of the step, the split would hold the
# tail's gradients beside the messages in flight; their dK and dV go as two messages (the kernel's own
# tensors, no flat copy beside them), and the last K/V are dropped before the dK/dV travel.
OVERLAP_MAX_TOKENS = 1024


def _ring_rank(group: dist.ProcessGroup | None, schedule: RingSchedule) -> int:
    if group is None:
        if schedule.offsets != (0,):
            raise ValueError("a ring schedule with transfers needs a process group (got group=None)")
        return 0
    return dist.get_rank(group)


def ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    schedule: RingSchedule,
    args: AttentionArgs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[b, s/P, h_q, d_qk]``, k ``[b, s/P, h_kv, d_qk]``, v ``[b, s/P, h_kv, d_v]`` (contiguous,
    this rank's shard of the layout ``schedule`` was computed for) -> out ``[b, s/P, h_q, d_v]``
    (dtype of q; 0 on rows no call touches), lse ``[b, h_q, s/P]``.  ``group`` may be None for a
    schedule without transfers."""
    rank = _ring_rank(group, schedule)
    if not schedule.transfers:
        return attend_local(q, k, v, schedule.calls[0][rank], args.softmax_scale, args.backend)
    out = lse = None
    comm = RingComm(group)
    kv = pack([k, v])  # [numel(k) + numel(v)]
    for i in range(len(schedule.offsets)):
        last = i + 1 == len(schedule.offsets)
        if not last:
            next_kv = comm.send_recv(kv, schedule.hop(i))
            comm.commit()
        k_i, v_i = unpack(kv, (k.shape, v.shape))  # K/V of rank (rank - offsets[i])
        calls = schedule.calls[i][rank]
        if out is None:  # step 0: the accumulators start as this step's result
            out, lse = attend_first(q, k_i, v_i, calls, args.softmax_scale, args.backend)
        else:
            attend_segments(q, k_i, v_i, calls, args.softmax_scale, args.backend, out, lse)
        if not last:
            comm.wait()
            kv = next_kv
    return out.to(q.dtype), lse


def ring_backward(
    rows: Rows,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    schedule: RingSchedule,
    args: AttentionArgs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`ring_forward`.

    Arguments:
        rows: q, out and lse as :func:`ring_forward` saw and returned them, dout ``[b, s/P, h_q, d_v]``;
            k, v: as :func:`ring_forward` saw them.
        group, schedule, args: as for :func:`ring_forward`.
    Returns:
        dq, dk, dv in the input dtypes.

    The dK/dV of the shard held now arrive from its previous holder, get this rank's block gradients and go
    on to its next holder (home after the last step): as many dK/dV messages as K/V messages, in the
    accumulator dtype (float32; float64 for float64). :class:`.block_loop.GradSum` sums them.
    """
    rank, q = _ring_rank(group, schedule), rows.q
    if not schedule.transfers:
        return attend_local_backward(rows, k, v, schedule.calls[0][rank], args.softmax_scale, args.backend)
    offsets, acc = schedule.offsets, rows.lse.dtype
    kv_comm, dkv_comm = RingComm(group, tag=0), RingComm(group, tag=1)
    dq = GradSum([q.shape], acc, q.device)  # [b, s/P, h_q, d_qk]
    own = GradSum([k.shape, v.shape], acc, q.device)  # this rank's dK/dV, kept at home
    kv = pack([k, v])  # [numel(k) + numel(v)]
    next_kv = kv_comm.send_recv(kv, schedule.hop(0))
    kv_comm.commit()
    local = schedule.calls[0][rank]
    # Short blocks are latency-bound: hide the last return behind part of the local block.  Long ones are
    # compute-bound, and the whole local block first keeps its kernel result as the accumulators.
    short = q.shape[1] <= OVERLAP_MAX_TOKENS
    head, tail = split_for_overlap(local) if short else (local, ())
    _step_backward(rows, k, v, head, args, dq, own)
    incoming = None
    for i in range(1, len(offsets)):
        last = i + 1 == len(offsets)
        kv_comm.wait()
        kv = next_kv
        if not last:
            next_kv = kv_comm.send_recv(kv, schedule.hop(i))
            kv_comm.commit()
        k_i, v_i = unpack(kv, (k.shape, v.shape))  # K/V of rank (rank - offsets[i])
        # short shards: one flat message [numel(k) + numel(v)]; long ones: dK and dV as they are
        # (a first contribution over every key is the kernel's own gradient, not a copy beside it)
        dkv = GradSum([k.shape, v.shape], acc, q.device, flat=short)
        _step_backward(rows, k_i, v_i, schedule.calls[i][rank], args, dq, dkv)
        del kv, k_i, v_i
        if last:
            next_kv = None  # the last K/V are not needed while the dK/dV travel
        if incoming is not None:
            dkv_comm.wait()
            dkv.add(0, k.shape[1], _received(incoming, k, v))  # dK/dV of the earlier holders
        incoming = _post(dkv_comm, dkv, schedule.hop(i) if not last else -offsets[i])  # to the next holder, or home
        del dkv
    _step_backward(rows, k, v, tail, args, dq, own)
    dkv_comm.wait()
    own.add(0, k.shape[1], _received(incoming, k, v))  # every other rank's contribution
    (dq,), (dk, dv) = dq.result(), own.result()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _post(comm: RingComm, dkv: GradSum, hop: int) -> list[torch.Tensor]:
    """Send the sums of ``dkv`` ``hop`` ranks on (one message if flat, else dK and dV); the receive buffers."""
    sends = [dkv.message()] if dkv.flat else dkv.result()
    received = [comm.send_recv(t, hop) for t in sends]
    comm.commit()
    return received


def _received(incoming: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """dK, dV of messages posted by :func:`_post`."""
    return unpack(incoming[0], (k.shape, v.shape)) if len(incoming) == 1 else incoming


def _step_backward(rows: Rows, k_i, v_i, calls, args: AttentionArgs, dq: GradSum, dkv: GradSum) -> None:
    """Add the gradients of ``calls`` (``rows`` against ``k_i``/``v_i``) to ``dq`` and ``dkv``.  One call over
    the whole block runs without slicing."""
    if whole(calls, rows.q.shape[1], k_i.shape[1]):
        dq_i, dk_i, dv_i = attend_whole_backward(rows, k_i, v_i, calls[0], args.softmax_scale, args.backend)
        dq.add(0, rows.q.shape[1], [dq_i])
        dkv.add(0, k_i.shape[1], [dk_i, dv_i])
        return
    attend_segments_backward(rows, k_i, v_i, calls, args.softmax_scale, args.backend, dq, dkv)


class RingAttention(PatternAttention):
    """``apply(q, k, v, group, schedule, args, sink=None)``: :func:`ring_forward` / :func:`ring_backward` with
    the attention sinks (:mod:`.sinks`)."""

    pattern_forward = staticmethod(ring_forward)
    pattern_backward = staticmethod(ring_backward)
