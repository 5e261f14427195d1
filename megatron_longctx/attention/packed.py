"""``cp_attention_packed``: context-parallel attention over packed documents (THD), document by document.

Megatron packs documents of different lengths into one sequence (``qkv_format="thd"``,
``PackedSeqParams`` with global ``cu_seqlens_q/kv`` and ``cu_seqlens_q/kv_padded``).  Under context
parallelism every document's padded slot is split into ``2*cp`` chunks and rank ``r`` keeps chunks
``r`` and ``2cp-1-r`` (:mod:`.packed_layout`, :mod:`.packed_sharding`).  This entry point validates
the inputs (``ValueError`` naming the parameter), moves ``[t, h, d]`` to the kernels' ``[1, t, h, d]``
and dispatches: ``ring``, ``ulysses`` and ``hybrid`` to :mod:`.packed_a2a` (all-to-all groups of size
1, cp or ``ulysses_size``, then the ring of :mod:`.ring` on a per-document schedule), ``allgather`` to
:mod:`.packed_allgather`.  Attention never crosses a document boundary; padding tokens get ``out = 0``
and zero gradients.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from ..kernels.base import BlockMask
from ..kernels.select import get_kernel
from .api import ALGORITHMS, AttentionArgs, _check_algorithm, _check_tensors, _check_window
from .packed_a2a import PackedA2AAttention, PackedA2APlan
from .packed_allgather import PackedAllGatherAttention, PackedAllGatherPlan
from .packed_layout import Packing, PackedLayout, group_order, partition_index
from .packed_plan import packed_pairs
from .packed_sharding import (
    PackedSeqFields,
    gather_packed_shards,
    pad_packed,
    packed_batch_on_this_cp_rank,
    packed_position_ids,
    packed_seq_fields,
    real_token_mask,
    shard_packed,
    unpad_packed,
    unshard_packed,
)

__all__ = [
    "Packing",
    "PackedLayout",
    "PackedSeqFields",
    "cp_attention_packed",
    "gather_packed_shards",
    "group_order",
    "pad_packed",
    "packed_batch_on_this_cp_rank",
    "packed_pairs",
    "packed_position_ids",
    "packed_seq_fields",
    "partition_index",
    "real_token_mask",
    "shard_packed",
    "unpad_packed",
    "unshard_packed",
]


def cp_attention_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group: dist.ProcessGroup | None,
    packing: Packing,
    *,
    algorithm: str,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    backend: str | None = None,
    ulysses_size: int | None = None,
    hcp_groups: Sequence[dist.ProcessGroup] | None = None,
) -> torch.Tensor:
    """Attention of this rank's packed tokens, each over its own document, sharded over ``cp_group``.

    Layouts (Megatron's THD): q ``[t/cp, h_q, d_qk]``, k ``[t/cp, h_kv, d_qk]``, v ``[t/cp, h_kv,
    d_v]`` -> out ``[t/cp, h_q, d_v]`` in q's dtype, with ``t = packing.padded_total``.  Each rank
    holds its tokens in the per-document zigzag layout (:func:`.packed_sharding.shard_packed`; what
    Megatron-Core's per-document ``get_batch_on_this_cp_rank`` produces).  ``packing``
    (:class:`.packed_layout.Packing`, e.g. ``Packing.from_packed_seq_params(packed_seq_params)``)
    holds the *global* ``cu_seqlens`` / ``cu_seqlens_padded``, the same on every rank; each padded
    document length must be a multiple of ``2*cp``.

    Positions are document-relative: ``causal`` and ``window_size=(left, right)`` (flash-attn
    convention, ``-1`` unbounded) apply inside each document.  ``algorithm``, ``softmax_scale``,
    ``backend``, ``ulysses_size`` and ``hcp_groups`` as in :func:`.api.cp_attention` (Ring Attention,
    Liu et al. 2023; Llama 3 all-gather; DeepSpeed-Ulysses, Jacobs et al. 2023; USP, Fang & Zhao 2024).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {ALGORITHMS} (Megatron's --cp-comm-type "
                         "p2p / all_gather / a2a / a2a+p2p map to them in that order)")
    if not isinstance(packing, Packing):
        raise ValueError(f"packing must be a Packing (Packing.from_cu_seqlens(cu_seqlens, cu_seqlens_padded)); "
                         f"got {type(packing).__name__}")
    _check_tensors(q, k, v, token_dims=1)
    if packing.total == 0:
        raise ValueError(f"packing holds no real token (cu_seqlens={list(packing.cu_seqlens)}); skip the call")
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    layout = PackedLayout(packing, cp_size)
    if q.shape[0] != layout.local_len:
        raise ValueError(
            f"q.shape[0]={q.shape[0]} local tokens, but packing describes cu_seqlens_padded[-1]="
            f"{packing.padded_total} tokens, i.e. {layout.local_len} per rank over cp={cp_size}; pass this "
            "rank's shard of the padded packed sequence (shard_packed) and the global cu_seqlens(_padded)"
        )
    mask = BlockMask(causal=bool(causal), window=_check_window(window_size))
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    try:
        get_kernel(backend, q.device)  # an unknown or unavailable backend fails before any transfer
    except ValueError as err:
        raise ValueError(f"backend={backend!r}: {err}") from None
    if cp_size > 1:
        _check_same_packing_across_ranks(q, k, v, packing, cp_group)
    # The dense checks see one "batch" row: [t, h, d] -> [t, 1, h, d].
    groups = _check_algorithm(algorithm, q.unsqueeze(1), k.unsqueeze(1), cp_group, cp_size, ulysses_size, hcp_groups)

    args = AttentionArgs(softmax_scale=scale, mask=mask, backend=backend)
    qb, kb, vb = (x.unsqueeze(0) for x in (q, k, v))  # [t/cp, h, d] -> [1, t/cp, h, d]
    if algorithm == "allgather" and cp_size > 1:
        out = PackedAllGatherAttention.apply(qb, kb, vb, cp_group, PackedAllGatherPlan(layout, args))
    else:
        a2a_group, ring_group, u = _a2a_and_ring(algorithm, cp_group, cp_size, groups)
        out = PackedA2AAttention.apply(qb, kb, vb, a2a_group, ring_group, PackedA2APlan(layout, u, args))
    return out.squeeze(0)  # [1, t/cp, h_q, d_v] -> [t/cp, h_q, d_v]


def _a2a_and_ring(algorithm: str, cp_group, cp_size: int, groups: tuple):
    """(all-to-all group, ring group, all-to-all size) of the a2a-then-ring pattern."""
    if cp_size == 1:
        return None, None, 1
    if algorithm == "ring":
        return None, cp_group, 1
    if algorithm == "ulysses":
        return cp_group, None, cp_size
    a2a, ring = groups
    u = dist.get_world_size(a2a)
    return (a2a if u > 1 else None), (ring if u < cp_size else None), u


def _checksum(offsets: tuple[int, ...]) -> int:
    return sum((i + 1) * x for i, x in enumerate(offsets)) % (1 << 61)


def _check_same_packing_across_ranks(q, k, v, packing: Packing, cp_group: dist.ProcessGroup) -> None:
    """Every rank must pass the same global packing and local shapes (checked where it costs no device sync: gloo)."""
    if dist.get_backend(cp_group) != "gloo":
        return
    mine = torch.tensor([*q.shape, *k.shape, *v.shape, packing.num_docs, _checksum(packing.cu_seqlens),
                         _checksum(packing.cu_seqlens_padded)], dtype=torch.int64)
    bounds = torch.stack([mine, -mine])  # [2, 12]: max and -min after the reduction
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=cp_group)
    if not torch.equal(bounds[0], -bounds[1]):
        raise ValueError(
            f"the ranks of cp_group disagree on the packing or the local shapes (this rank: {packing.num_docs} "
            f"documents, cu_seqlens_padded[-1]={packing.padded_total}, q {tuple(q.shape)}): pass every rank the same "
            "global cu_seqlens / cu_seqlens_padded and its own shard of the packed sequence"
        )
