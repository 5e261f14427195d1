"""All-gather attention: every rank gathers the whole K/V once and attends its own queries.

The context-parallel attention of Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.2;
Megatron/TE ``cp_comm_type="all_gather"``): one all-gather of K/V in forward, and in backward the
K/V are gathered again (rather than kept, P times the local size) and dK/dV are reduce-scattered
back to their owners.  The gathered shards are put back in natural order
(:func:`.layout.from_ranks` with ``U = cp``), where each document is one contiguous key run, so
each local query chunk is one kernel call over the keys of its document it can see (dense: one
document).  Layout inside: ``[b, s, h, d]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .args import AttentionArgs
from .block_loop import GradSum, Rows, attend_segments, attend_segments_backward, new_accumulators
from .comm import all_gather, pack, reduce_scatter
from .layout import SeqLayout, from_ranks, pooled_index, to_ranks
from .pattern import PatternAttention
from .schedule import allgather_calls


def gather_kv(k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, index):
    """Local k ``[b, t, h_kv, d_qk]``, v ``[b, t, h_kv, d_v]`` -> the gathered ones ``[b, P*t, h_kv, d]``."""
    p = dist.get_world_size(group)
    gathered = all_gather(pack([k, v]), group)  # [P, numel(k) + numel(v)]
    k_all = from_ranks(gathered[:, : k.numel()].view(p, *k.shape), index)  # [b, P*t, h_kv, d_qk]
    v_all = from_ranks(gathered[:, k.numel():].view(p, *v.shape), index)  # [b, P*t, h_kv, d_v]
    return k_all, v_all


def scatter_kv_grads(grads: list, group: dist.ProcessGroup, index, local_shapes) -> list[torch.Tensor]:
    """The gathered ``grads`` ``[dk_all, dv_all]`` (``[b, P*t, h_kv, d]``, natural order) summed over the
    ranks into this rank's ``[b, t, h_kv, d]`` shares, shaped ``local_shapes``.

    The list is consumed, one gradient at a time: its rank-ordered copy is the send buffer of its own
    reduce-scatter, and it is dropped before the copy is sent, so at most one gradient, its send buffer
    and the next gradient are alive (not both gradients and a send buffer for both).
    """
    p = dist.get_world_size(group)
    out = []
    for shape in local_shapes:
        send = to_ranks(grads.pop(0), p, index).view(p, -1)  # [P, numel of one rank's share]
        out.append(reduce_scatter(send, group).view(shape))
        del send
    return out


def allgather_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, layout: SeqLayout,
    args: AttentionArgs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[b, t, h_q, d_qk]``, k/v ``[b, t, h_kv, d]`` (this rank's shard of ``layout``)
    -> out ``[b, t, h_q, d_v]`` (dtype of q), lse ``[b, h_q, t]``."""
    k_all, v_all = gather_kv(k, v, group, pooled_index(layout, layout.cp_size, q.device))
    calls = allgather_calls(layout, dist.get_rank(group), args.mask)
    out, lse = new_accumulators(q, v.shape[-1])
    attend_segments(q, k_all, v_all, calls, args.softmax_scale, args.backend, out, lse)
    return out.to(q.dtype), lse


def allgather_backward(
    rows: Rows,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    layout: SeqLayout,
    args: AttentionArgs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`allgather_forward` in the input dtypes; dK/dV are reduced in the
    accumulator dtype (float32; float64 for float64 inputs)."""
    q, p, acc = rows.q, dist.get_world_size(group), rows.lse.dtype
    index = pooled_index(layout, p, q.device)
    k_all, v_all = gather_kv(k, v, group, index)
    calls = allgather_calls(layout, dist.get_rank(group), args.mask)
    dq = GradSum([q.shape], acc, q.device)  # [b, t, h_q, d_qk]
    dkv_all = GradSum([k_all.shape, v_all.shape], acc, q.device)  # [b, P*t, h_kv, d_qk], [b, P*t, h_kv, d_v]
    attend_segments_backward(rows, k_all, v_all, calls, args.softmax_scale, args.backend, dq, dkv_all)
    del k_all, v_all
    (dq,), grads = dq.result(), dkv_all.result()
    del dkv_all
    dk, dv = scatter_kv_grads(grads, group, index, (k.shape, v.shape))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class AllGatherAttention(PatternAttention):
    """``apply(q, k, v, group, layout, args, sink=None)``: :func:`allgather_forward` / :func:`allgather_backward`
    with the attention sinks (:mod:`.sinks`)."""

    pattern_forward = staticmethod(allgather_forward)
    pattern_backward = staticmethod(allgather_backward)
