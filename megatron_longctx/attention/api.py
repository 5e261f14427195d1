"""``cp_attention``: context-parallel attention over Megatron's load-balanced sequence shards.

Entry point of the package, for dense ``[s, b, h, d]`` sequences and packed ``[t, h, d]`` documents
(THD) alike.  Validates the inputs (:mod:`.args`: every unsupported case is a ``ValueError`` naming
the parameter; an unavailable ``backend`` is the kernels' ``KernelUnsupported``), checks once per
configuration that every rank agrees (:mod:`.agreement`), describes the tokens as one
:class:`.layout.SeqLayout` (a dense sequence is one document), moves them to the kernels' ``[b, t,
h, d]`` and dispatches to one communication pattern: :mod:`.ring`, :mod:`.allgather` or
:mod:`.ulysses` (Ulysses and the hybrid).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..kernels.base import BlockMask
from ..kernels.select import get_kernel
from .ulysses import ulysses_attention
from .agreement import check_ranks_agree
from .allgather import AllGatherAttention
from .args import (
    ALGORITHMS,
    AttentionArgs,
    attention_args,
    check_algorithm_name,
    check_local_length,
    check_tensors,
    check_ulysses_size,
    check_window,
)
from .hybrid import a2a_and_ring_groups, check_hcp_groups
from .layout import Packing, SeqLayout
from .ring import RingAttention
from .schedule import ring_schedule, schedule_pairs
from .sharding import check_divisible
from .sinks import check_softmax_offset

__all__ = ["ALGORITHMS", "cp_attention", "cp_attention_packed", "schedule_flops"]


def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group: dist.ProcessGroup | None,
    *,
    algorithm: str,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    backend: str | None = None,
    ulysses_size: int | None = None,
    hcp_groups: Sequence[dist.ProcessGroup] | None = None,
    packing: Packing | None = None,
    softmax_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, sharded over ``cp_group``.

    Layouts (Megatron's): q ``[s/cp, b, h_q, d_qk]``, k ``[s/cp, b, h_kv, d_qk]``, v
    ``[s/cp, b, h_kv, d_v]`` -> out ``[s/cp, b, h_q, d_v]`` in q's dtype.  ``h_q % h_kv == 0``
    (GQA/MQA heads are not expanded); ``d_v`` may differ from ``d_qk`` (MLA).  Each rank holds its
    shard in Megatron's load-balanced layout (:func:`.sharding.shard_sequence`: chunks ``r`` and
    ``2cp-1-r`` of ``2cp``), with equal shapes on every rank.

    ``algorithm``: ``"ring"`` (Ring Attention, Liu et al. 2023, zigzag load balance),
    ``"allgather"`` (Llama 3), ``"ulysses"`` (DeepSpeed-Ulysses, Jacobs et al. 2023) or
    ``"hybrid"`` (USP / LoongTrain: Ulysses inside groups of ``ulysses_size`` consecutive ranks,
    ring across them; or pass Megatron's hierarchical groups as ``hcp_groups=(a2a_group,
    ring_group)``, inner all-to-all group first, as ``pg_collection.hcp`` /
    ``parallel_state.get_hierarchical_context_parallel_groups()`` give them).  ``causal`` and
    ``window_size=(left, right)`` follow flash-attn (``-1`` unbounded; the right side is 0 under
    ``causal``).  ``softmax_scale`` defaults to ``1/sqrt(d_qk)``.  ``backend`` names the block
    kernel (default: chosen by :mod:`megatron_longctx.kernels`).  ``cp_group`` None or of size 1:
    plain local attention.  The softmax statistics accumulate in float32 (float64 for float64).

    The first call of a configuration checks with one small collective that every rank of
    ``cp_group`` passes the same configuration (:func:`.agreement.check_ranks_agree`); a mismatch
    raises on every rank, naming the parameter and the ranks.

    ``packing`` (:class:`.layout.Packing`): packed documents (THD): q/k/v are then
    ``[t/cp, h, d]`` in the per-document load-balanced layout and each token attends only within
    its document; see :func:`cp_attention_packed`.

    ``softmax_offset`` ``[h_q]`` (attention sinks, :mod:`.sinks`; Megatron's ``--softmax-type``
    ``off-by-one`` passes zeros, ``learnable`` its parameter): one more logit per head in every row's
    softmax denominator, with no value.  Differentiable; its gradient on each rank covers the rows
    (Ulysses: the heads) this rank attends, so the sum over ``cp_group`` is the whole gradient (what
    Megatron's data-parallel reduction over ``dp_cp`` forms).
    """
    if packing is not None:
        return cp_attention_packed(q, k, v, cp_group, packing, algorithm=algorithm, causal=causal,
                                   softmax_scale=softmax_scale, window_size=window_size, backend=backend,
                                   ulysses_size=ulysses_size, hcp_groups=hcp_groups, softmax_offset=softmax_offset)
    check_algorithm_name(algorithm)
    check_tensors(q, k, v)
    check_softmax_offset(softmax_offset, q, head_dim=2)
    args = attention_args(q, causal, softmax_scale, window_size, backend)
    cp_size = _cp_size(cp_group)
    _check_backend(backend, q.device)
    check_ulysses_size(algorithm, cp_size, q.shape[2], ulysses_size, hcp_groups)
    if cp_size > 1:
        check_local_length(q.shape[0], cp_size)
    layout = SeqLayout.dense(q.shape[0] * cp_size, cp_size)
    qb, kb, vb = (x.transpose(0, 1) for x in (q, k, v))  # [s/cp, b, h, d] -> [b, s/cp, h, d]
    out = _attend(qb, kb, vb, cp_group, layout, args, algorithm, ulysses_size, hcp_groups, softmax_offset)
    return out.transpose(0, 1).contiguous()  # [b, s/cp, h_q, d_v] -> [s/cp, b, h_q, d_v]


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
    softmax_offset: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this rank's packed tokens, each over its own document, sharded over ``cp_group``.

    Layouts (Megatron's THD): q ``[t/cp, h_q, d_qk]``, k ``[t/cp, h_kv, d_qk]``, v ``[t/cp, h_kv,
    d_v]`` -> out ``[t/cp, h_q, d_v]`` in q's dtype, with ``t = packing.padded_total``.  Each rank
    holds its tokens in the per-document zigzag layout (:func:`.packed_sharding.shard_packed`; what
    Megatron-Core's per-document ``get_batch_on_this_cp_rank`` produces).  ``packing``
    (:class:`.layout.Packing`, e.g. ``Packing.from_packed_seq_params(packed_seq_params)``)
    holds the *global* ``cu_seqlens`` / ``cu_seqlens_padded``, the same on every rank; each padded
    document length must be a multiple of ``2*cp``.

    Positions are document-relative: ``causal`` and ``window_size=(left, right)`` (flash-attn
    convention, ``-1`` unbounded) apply inside each document.  ``algorithm``, ``softmax_scale``,
    ``backend``, ``ulysses_size``, ``hcp_groups`` and ``softmax_offset`` as in :func:`cp_attention` (Ring Attention,
    Liu et al. 2023; Llama 3 all-gather; DeepSpeed-Ulysses, Jacobs et al. 2023; USP, Fang & Zhao 2024).
    Attention never crosses a document boundary; padding tokens get ``out = 0`` and zero gradients.
    """
    check_algorithm_name(algorithm)
    if not isinstance(packing, Packing):
        raise ValueError(f"packing must be a Packing (Packing.from_cu_seqlens(cu_seqlens, cu_seqlens_padded)); "
                         f"got {type(packing).__name__}")
    check_tensors(q, k, v, token_dims=1)
    check_softmax_offset(softmax_offset, q, head_dim=1)
    if packing.total == 0:
        raise ValueError(f"packing holds no real token (cu_seqlens={list(packing.cu_seqlens)}); skip the call")
    cp_size = _cp_size(cp_group)
    packing.check_cp(cp_size)
    layout = SeqLayout(packing, cp_size)
    if q.shape[0] != layout.local_len:
        raise ValueError(
            f"q.shape[0]={q.shape[0]} local tokens, but packing describes cu_seqlens_padded[-1]="
            f"{packing.padded_total} tokens, i.e. {layout.local_len} per rank over cp={cp_size}; pass this "
            "rank's shard of the padded packed sequence (shard_packed) and the global cu_seqlens(_padded)"
        )
    args = attention_args(q, causal, softmax_scale, window_size, backend)
    _check_backend(backend, q.device)
    check_ulysses_size(algorithm, cp_size, q.shape[1], ulysses_size, hcp_groups)
    qb, kb, vb = (x.unsqueeze(0) for x in (q, k, v))  # [t/cp, h, d] -> [1, t/cp, h, d]
    out = _attend(qb, kb, vb, cp_group, layout, args, algorithm, ulysses_size, hcp_groups, softmax_offset)
    return out.squeeze(0)  # [1, t/cp, h_q, d_v] -> [t/cp, h_q, d_v]


def _cp_size(cp_group: dist.ProcessGroup | None) -> int:
    return 1 if cp_group is None else dist.get_world_size(cp_group)


def _check_backend(backend: str | None, device: torch.device) -> None:
    try:
        get_kernel(backend, device)  # an unknown or unavailable backend fails here, before any transfer
    except ValueError as err:
        raise ValueError(f"backend={backend!r}: {err}") from None


def _attend(q, k, v, cp_group, layout: SeqLayout, args: AttentionArgs, algorithm: str, ulysses_size,
            hcp_groups, sink: torch.Tensor | None) -> torch.Tensor:
    """q/k/v ``[b, t, h, d]`` (this rank's shard of ``layout``) -> out ``[b, t, h_q, d_v]``: the
    cross-rank agreement check, the groups, then one communication pattern (``sink`` ``[h_q]``: the
    attention sinks, added to each row's merged result)."""
    cp_size = layout.cp_size
    if cp_size > 1 and algorithm == "hybrid" and hcp_groups is not None:
        check_hcp_groups(hcp_groups, cp_group, cp_size, ulysses_size, q.shape[2])  # before any collective
    if cp_size > 1:
        check_ranks_agree(cp_group, algorithm=algorithm, args=args, q=q, k=k, v=v, packing=layout.packing,
                          ulysses_size=ulysses_size, hcp=hcp_groups is not None, sink=sink is not None)
    a2a_group, ring_group = a2a_and_ring_groups(algorithm, cp_group, cp_size, ulysses_size, hcp_groups, q.shape[2])
    if algorithm == "allgather" and cp_size > 1:
        return AllGatherAttention.apply(q, k, v, cp_group, layout, args, sink)
    if a2a_group is None:  # the ring over cp_group (one rank: local attention)
        return RingAttention.apply(q, k, v, ring_group, ring_schedule(layout, args.mask), args, sink)
    return ulysses_attention(q, k, v, a2a_group, ring_group, layout, args, sink)


def schedule_flops(
    algorithm: str,
    cp_size: int,
    seq_len: int,
    *,
    causal: bool = True,
    window_size: tuple[int, int] | None = None,
    batch: int = 1,
    heads: int = 1,
    d_qk: int = 128,
    d_v: int | None = None,
    ulysses_size: int | None = None,
    zigzag: bool = True,
) -> list[int]:
    """Forward attention FLOPs each rank executes, read off the schedule the algorithm runs.

    Counts ``2*(d_qk + d_v)`` FLOPs per visible (query, key) pair per head and batch row (the two
    matmuls; backward is about 2.5x this).  ``zigzag=False`` prices naive contiguous sharding (ring
    and all-gather only).  ``heads`` are query heads.  Pure function: no process group needed.
    """
    d_v = d_qk if d_v is None else d_v
    mask = BlockMask(causal=causal, window=check_window(window_size))
    check_divisible(seq_len, cp_size, "seq_len")
    check_algorithm_name(algorithm)
    pairs, heads_divisor = schedule_pairs(algorithm, SeqLayout.dense(seq_len, cp_size, zigzag), mask, ulysses_size)
    return [2 * (d_qk + d_v) * batch * (p * heads // heads_divisor) for p in pairs]
