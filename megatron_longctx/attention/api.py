"""``cp_attention``: context-parallel attention over Megatron's load-balanced sequence shards, dense and
packed (THD) alike: checks, one :class:`.layout.SeqLayout`, then :mod:`.ring`, :mod:`.allgather` or
:mod:`.ulysses` (Ulysses and the hybrid).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..kernels.base import BlockMask
from ..kernels.select import get_kernel
from .. import cp_algorithms as algorithms
from .agreement import check_ranks_agree
from .allgather import AllGatherAttention
from .args import (
    ALGORITHMS,
    AttentionArgs,
    attention_args,
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
from .ulysses import ulysses_attention

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

    Arguments:
        q: ``[s/cp, b, h_q, d_qk]`` (packed: ``[t/cp, h_q, d_qk]``), this rank's shard in Megatron's
            load-balanced layout (chunks ``r`` and ``2cp-1-r`` of ``2cp``, :func:`.sharding.shard_sequence`;
            packed: per document, :func:`.packed_sharding.shard_packed`); equal shapes on every rank.
        k, v: ``[s/cp, b, h_kv, d_qk]`` and ``[s/cp, b, h_kv, d_v]``; ``h_q % h_kv == 0`` (GQA/MQA, heads not
            expanded); ``d_v`` may differ from ``d_qk`` (MLA).
        cp_group: the context-parallel group; ``None`` or size 1: local attention.
        algorithm: ``"ring"`` (Ring Attention, zigzag), ``"allgather"`` (Llama 3), ``"ulysses"``
            (DeepSpeed-Ulysses) or ``"hybrid"`` (USP: Ulysses inside groups, ring across).
        causal, window_size: flash-attn's convention, ``(left, right)``, ``-1`` unbounded; packed: inside
            each document.
        softmax_scale: defaults to ``1/sqrt(d_qk)``.
        backend: the block kernel (:data:`megatron_longctx.kernels.BACKENDS`); default: chosen per device.
        ulysses_size: ``"hybrid"``: ranks per all-to-all group (consecutive ranks).
        hcp_groups: ``"hybrid"``: Megatron's ``(a2a_group, ring_group)`` instead of ``ulysses_size``.
        packing: packed documents (THD, :class:`.layout.Packing` of the *global* ``cu_seqlens``); attention
            never crosses a document; padding tokens get zeros and zero gradients.
        softmax_offset: ``[h_q]`` attention sinks (:mod:`.sinks`): one more logit per head in each row's
            softmax denominator; its gradient here covers this rank's rows (summed over ``cp_group``, it is
            the whole gradient).
    Returns:
        out: ``[s/cp, b, h_q, d_v]`` (packed: ``[t/cp, h_q, d_v]``) in q's dtype; the softmax statistics
        accumulate in float32 (float64 for float64).

    Every unsupported case is a ``ValueError`` naming the argument; the first call of a configuration checks
    with one small collective that every rank passes the same one (:func:`.agreement.check_ranks_agree`).
    """
    algorithms.get(algorithm)  # an unknown name fails here, before anything else
    cp_size = _cp_size(cp_group)
    head_dim = 2 if packing is None else 1
    if packing is None:
        check_tensors(q, k, v)
    else:
        if not isinstance(packing, Packing):
            raise ValueError(f"packing must be a Packing (Packing.from_cu_seqlens(cu_seqlens, cu_seqlens_padded)); "
                             f"got {type(packing).__name__}")
        check_tensors(q, k, v, token_dims=1)
    check_softmax_offset(softmax_offset, q, head_dim=head_dim)
    layout = _layout(q, cp_size, packing)
    args = attention_args(q, causal, softmax_scale, window_size, backend)
    _check_backend(backend, q.device)
    check_ulysses_size(algorithm, cp_size, q.shape[head_dim], ulysses_size, hcp_groups)
    if packing is None:  # [s/cp, b, h, d] <-> [b, s/cp, h, d]
        blocks, unblock = (x.transpose(0, 1) for x in (q, k, v)), lambda o: o.transpose(0, 1).contiguous()
    else:  # [t/cp, h, d] <-> [1, t/cp, h, d]
        blocks, unblock = (x.unsqueeze(0) for x in (q, k, v)), lambda o: o.squeeze(0)
    return unblock(_attend(*blocks, cp_group, layout, args, algorithm, ulysses_size, hcp_groups, softmax_offset))


def cp_attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: dist.ProcessGroup | None,
                        packing: Packing, **kwargs) -> torch.Tensor:
    """:func:`cp_attention` of packed documents (THD): q/k/v ``[t/cp, h, d]``, ``t = packing.padded_total``,
    each padded document length a multiple of ``2*cp``; the same keyword arguments."""
    return cp_attention(q, k, v, cp_group, packing=packing, **kwargs)


def _layout(q: torch.Tensor, cp_size: int, packing: Packing | None) -> SeqLayout:
    """The tokens of all ranks as one :class:`SeqLayout` (a dense sequence is one document)."""
    if packing is None:
        if cp_size > 1:
            check_local_length(q.shape[0], cp_size)
        return SeqLayout.dense(q.shape[0] * cp_size, cp_size)
    if packing.total == 0:
        raise ValueError(f"packing holds no real token (cu_seqlens={list(packing.cu_seqlens)}); skip the call")
    packing.check_cp(cp_size)
    layout = SeqLayout(packing, cp_size)
    if q.shape[0] != layout.local_len:
        raise ValueError(
            f"q.shape[0]={q.shape[0]} local tokens, but packing describes cu_seqlens_padded[-1]="
            f"{packing.padded_total} tokens, i.e. {layout.local_len} per rank over cp={cp_size}; pass this "
            "rank's shard of the padded packed sequence (shard_packed) and the global cu_seqlens(_padded)"
        )
    return layout


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
    cp_size, algo = layout.cp_size, algorithms.get(algorithm)
    if cp_size > 1 and algo.heads == "groups" and hcp_groups is not None:
        check_hcp_groups(hcp_groups, cp_group, cp_size, ulysses_size, q.shape[2])  # before any collective
    if cp_size > 1:
        check_ranks_agree(cp_group, algorithm=algorithm, args=args, q=q, k=k, v=v, packing=layout.packing,
                          ulysses_size=ulysses_size, hcp=hcp_groups is not None, sink=sink is not None)
    a2a_group, ring_group = a2a_and_ring_groups(algorithm, cp_group, cp_size, ulysses_size, hcp_groups, q.shape[2])
    if algo.gathers_kv and cp_size > 1:
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
    heads: int = 1,
    d_qk: int = 128,
    d_v: int | None = None,
    ulysses_size: int | None = None,
    zigzag: bool = True,
) -> list[int]:
    """Forward attention FLOPs each rank executes, read off the schedule the algorithm runs.

    Counts ``2*(d_qk + d_v)`` FLOPs per visible (query, key) pair per head of one sequence (the two
    matmuls; backward is about 2.5x this; a batch multiplies it).  ``zigzag=False`` prices naive contiguous sharding (ring
    and all-gather only).  ``heads`` are query heads.  Pure function: no process group needed.
    """
    d_v = d_qk if d_v is None else d_v
    mask = BlockMask(causal=causal, window=check_window(window_size))
    check_divisible(seq_len, cp_size, "seq_len")
    algorithms.get(algorithm)
    pairs, heads_divisor = schedule_pairs(algorithm, SeqLayout.dense(seq_len, cp_size, zigzag), mask, ulysses_size)
    return [2 * (d_qk + d_v) * (p * heads // heads_divisor) for p in pairs]
