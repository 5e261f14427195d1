"""All-gather attention over packed (THD) shards: gather the whole K/V once, attend per document.

The context-parallel attention of Llama 3 (Dubey et al. 2024, §3.3.2; Megatron/TE
``cp_comm_type="all_gather"``) on per-document zigzag shards.  The gathered shards are put back in
natural padded order (:func:`.packed_layout.group_order` with ``U = cp``), where each document is one
contiguous key run, so every local query chunk is one kernel call over its own document's keys.
Backward gathers K/V again and reduce-scatters dK/dV to their owners.  Layout ``[b, t, h, d]``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .comm import all_gather, pack, reduce_scatter, unpack
from .packed_layout import PackedLayout, group_order
from .packed_plan import packed_allgather_calls
from .segments import attend_segments, attend_segments_backward, new_accumulators

if TYPE_CHECKING:
    from .api import AttentionArgs


@dataclasses.dataclass(frozen=True)
class PackedAllGatherPlan:
    layout: PackedLayout
    args: AttentionArgs


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor):
    """Local k ``[b, t, h_kv, d_qk]``, v ``[b, t, h_kv, d_v]`` -> natural packed ``[b, P*t, h_kv, d]``."""
    p = dist.get_world_size(group)
    gathered = all_gather(pack([k, v]), group)  # [P, numel(k) + numel(v)]
    out = []
    for part, like in ((gathered[:, : k.numel()], k), (gathered[:, k.numel():], v)):
        b, t, h, d = like.shape
        pooled = part.reshape(p, b, t, h, d).transpose(0, 1).reshape(b, p * t, h, d)  # rank-major
        out.append(pooled.index_select(1, order))  # [b, P*t, h_kv, d], natural padded order
    return out


def packed_allgather_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, plan: PackedAllGatherPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[b, t, h_q, d_qk]``, k/v ``[b, t, h_kv, d]`` -> out ``[b, t, h_q, d_v]`` (q's dtype), lse ``[b, h_q, t]``."""
    order = group_order(plan.layout, plan.layout.cp_size, q.device)
    k_all, v_all = _gather_kv(k, v, group, order)
    calls = packed_allgather_calls(plan.layout, dist.get_rank(group), plan.args.mask)
    out, lse = new_accumulators(q, v.shape[-1])
    attend_segments(q, k_all, v_all, calls, plan.args.softmax_scale, plan.args.backend, out, lse)
    return out.to(q.dtype), lse


def packed_allgather_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    group: dist.ProcessGroup,
    plan: PackedAllGatherPlan,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`packed_allgather_forward` in the input dtypes (dK/dV reduced in the accumulator dtype)."""
    p, acc = dist.get_world_size(group), lse.dtype
    order = group_order(plan.layout, p, q.device)
    k_all, v_all = _gather_kv(k, v, group, order)
    calls = packed_allgather_calls(plan.layout, dist.get_rank(group), plan.args.mask)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # [b, t, h_q, d_qk]
    dk_all = torch.zeros(k_all.shape, dtype=acc, device=q.device)  # [b, P*t, h_kv, d_qk]
    dv_all = torch.zeros(v_all.shape, dtype=acc, device=q.device)  # [b, P*t, h_kv, d_v]
    attend_segments_backward(
        dout, q, k_all, v_all, out, lse, calls, plan.args.softmax_scale, plan.args.backend, dq, dk_all, dv_all
    )
    per_rank = []
    for g, like in ((dk_all, k), (dv_all, v)):
        b, t, h, d = like.shape
        pooled = torch.empty_like(g).index_copy_(1, order, g)  # [b, P*t, h, d], rank-major
        per_rank.append(pooled.view(b, p, t, h, d).transpose(0, 1).reshape(p, -1))  # [P, numel]
    dkv = reduce_scatter(torch.cat(per_rank, dim=1), group)  # [numel(k) + numel(v)]
    dk, dv = unpack(dkv, (k.shape, v.shape))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class PackedAllGatherAttention(torch.autograd.Function):
    """Autograd wrapper of :func:`packed_allgather_forward` / :func:`packed_allgather_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, group, plan):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = packed_allgather_forward(q, k, v, group, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plan = group, plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = packed_allgather_backward(dout.contiguous(), q, k, v, out, lse, ctx.group, ctx.plan)
        return dq, dk, dv, None, None
