"""``cp_attention``: context-parallel attention over Megatron's load-balanced sequence shards.

Entry point of the package.  Validates the inputs (every unsupported case is a ``ValueError`` naming
the parameter; an unavailable ``backend`` is the kernels' ``KernelUnsupported``), moves
Megatron's ``[s, b, h, d]`` to the kernels' ``[b, s, h, d]`` and dispatches to one communication
pattern: :mod:`.ring`, :mod:`.allgather`, :mod:`.ulysses` or :mod:`.hybrid`.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Sequence

import torch
import torch.distributed as dist

from ..kernels.base import BlockMask
from ..kernels.select import get_kernel
from .allgather import AllGatherAttention, allgather_calls
from .hybrid import hybrid_groups, hybrid_ranks
from .packed_layout import Packing
from .ring import RingAttention, local_schedule, ring_schedule
from .sharding import SeqLayout, check_divisible
from .ulysses import UlyssesAttention, kv_replication

ALGORITHMS = ("ring", "allgather", "ulysses", "hybrid")


@dataclasses.dataclass(frozen=True)
class AttentionArgs:
    """Non-tensor arguments shared by every pattern."""

    softmax_scale: float  # multiplies q·k before the softmax
    mask: BlockMask  # causal flag and sliding window, as a function of global positions
    backend: str | None  # block kernel name for kernels.select.kernel_for; None = automatic


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

    ``packing`` (:class:`.packed_layout.Packing`): packed documents (THD): q/k/v are then
    ``[t/cp, h, d]`` in the per-document load-balanced layout and each token attends only within
    its document; see :func:`.packed.cp_attention_packed`.
    """
    if packing is not None:
        from .packed import cp_attention_packed  # built on this module: imported on use

        return cp_attention_packed(q, k, v, cp_group, packing, algorithm=algorithm, causal=causal,
                                   softmax_scale=softmax_scale, window_size=window_size, backend=backend,
                                   ulysses_size=ulysses_size, hcp_groups=hcp_groups)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} is not one of {ALGORITHMS} (Megatron's --cp-comm-type "
                         "p2p / all_gather / a2a / a2a+p2p map to them in that order)")
    _check_tensors(q, k, v)
    mask = BlockMask(causal=bool(causal), window=_check_window(window_size))
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    try:
        get_kernel(backend, q.device)  # an unknown or unavailable backend fails here, before any transfer
    except ValueError as err:
        raise ValueError(f"backend={backend!r}: {err}") from None
    groups = _check_algorithm(algorithm, q, k, cp_group, cp_size, ulysses_size, hcp_groups)
    if cp_size > 1:
        _check_local_length(q.shape[0], cp_size)
        _check_same_shapes_across_ranks(q, k, v, cp_group)

    qb, kb, vb = (x.transpose(0, 1) for x in (q, k, v))  # [s/cp, b, h, d] -> [b, s/cp, h, d]
    args = AttentionArgs(softmax_scale=scale, mask=mask, backend=backend)
    if cp_size == 1:
        out = RingAttention.apply(qb, kb, vb, None, local_schedule(q.shape[0], mask), args)
    elif algorithm == "ring":
        schedule = ring_schedule(SeqLayout(cp_size, q.shape[0] // 2), mask)
        out = RingAttention.apply(qb, kb, vb, cp_group, schedule, args)
    elif algorithm == "allgather":
        out = AllGatherAttention.apply(qb, kb, vb, cp_group, SeqLayout(cp_size, q.shape[0] // 2), args)
    elif algorithm == "ulysses":
        out = UlyssesAttention.apply(qb, kb, vb, cp_group, None, args)
    else:
        out = UlyssesAttention.apply(qb, kb, vb, *groups, args)  # all-to-all group, ring group
    return out.transpose(0, 1).contiguous()  # [b, s/cp, h_q, d_v] -> [s/cp, b, h_q, d_v]


# token dims -> (layout, what q, k and v must share)
_LAYOUTS = {2: ("[s, b, h, d]", "agree on [s, b]"), 1: ("[t, h, d] (THD)", "hold the same tokens")}


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_dims: int = 2) -> None:
    """q, k, v agree as self-attention inputs: ``token_dims`` leading token dims ([s, b] or packed [t]),
    then heads and head dim."""
    (layout, same_tokens), ndim = _LAYOUTS[token_dims], token_dims + 2
    if q.dim() != ndim or k.dim() != ndim or v.dim() != ndim:
        raise ValueError(f"q, k, v must be {layout}; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if not (q.shape[:token_dims] == k.shape[:token_dims] == v.shape[:token_dims]):
        raise ValueError(f"q, k, v must {same_tokens} (self-attention); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of heads; got k {hkv}, v {v.shape[-2]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim d_qk; got q {q.shape[-1]}, k {k.shape[-1]}")
    if hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hkv}) (GQA/MQA)")
    if token_dims == 2 and (q.shape[0] == 0 or q.shape[1] == 0):
        raise ValueError(f"q has an empty sequence or batch: {tuple(q.shape)}")


def _check_window(window_size) -> tuple[int, int]:
    if window_size is None:
        return (-1, -1)
    try:
        left, right = (operator.index(w) for w in window_size)
    except (TypeError, ValueError):
        left = right = -2
    if left < -1 or right < -1:
        raise ValueError(f"window_size={window_size!r} must be (left, right) with ints >= 0, or -1 for unbounded")
    return left, right


def _check_local_length(s_local: int, cp_size: int) -> None:
    if s_local % 2 != 0:
        raise ValueError(
            f"q.shape[0]={s_local}: each rank holds 2 of the 2*cp={2 * cp_size} chunks, so the global "
            f"sequence length (s_global = cp*{s_local} = {cp_size * s_local}) must be divisible by "
            f"2*cp={2 * cp_size}; pad the sequence (Megatron: --seq-length)"
        )


def _check_same_shapes_across_ranks(q, k, v, cp_group: dist.ProcessGroup) -> None:
    """Every rank must hold the same local shapes (checked where it costs no device sync: gloo)."""
    if dist.get_backend(cp_group) != "gloo":
        return
    mine = torch.tensor([*q.shape, *k.shape, *v.shape], dtype=torch.int64)
    bounds = torch.stack([mine, -mine])  # [2, 12]: max and -min after the reduction
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=cp_group)
    if not torch.equal(bounds[0], -bounds[1]):
        raise ValueError(
            f"q/k/v shapes differ across the ranks of cp_group (this rank: q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}): every rank must hold s_global/cp tokens, with s_global "
            "divisible by 2*cp"
        )


def _check_algorithm(algorithm, q, k, cp_group, cp_size, ulysses_size, hcp_groups) -> tuple:
    """Validate the algorithm's own parameters; returns the hybrid's (a2a_group, ring_group)."""
    hq, hkv = q.shape[2], k.shape[2]
    if algorithm in ("ring", "allgather") and (ulysses_size is not None or hcp_groups is not None):
        raise ValueError(f"ulysses_size / hcp_groups apply to algorithm='hybrid' (or 'ulysses'), "
                         f"not {algorithm!r}")
    if algorithm == "ulysses":
        if hcp_groups is not None or ulysses_size not in (None, cp_size):
            raise ValueError(f"algorithm='ulysses' spans the whole cp_group (size {cp_size}); got ulysses_size="
                             f"{ulysses_size}, hcp_groups={hcp_groups}: use algorithm='hybrid' for a smaller "
                             "a2a group")
        if cp_size > 1:
            kv_replication(hq, hkv, cp_size)  # raises the ValueError for hq % cp != 0
    if algorithm != "hybrid" or cp_size == 1:
        return ()
    if hcp_groups is not None:
        return _check_hcp_groups(hcp_groups, cp_group, cp_size, ulysses_size, hq)
    if ulysses_size is None:
        raise ValueError("algorithm='hybrid' needs ulysses_size= (the all-to-all group size) or hcp_groups=")
    if not isinstance(ulysses_size, int) or ulysses_size < 1 or cp_size % ulysses_size != 0:
        raise ValueError(f"ulysses_size={ulysses_size} must be a positive divisor of the cp size {cp_size}")
    if hq % ulysses_size != 0:
        raise ValueError(f"ulysses_size={ulysses_size} must divide the query heads ({hq}); choose a divisor of "
                         f"both {hq} and {cp_size}, or use algorithm='ring'")
    return hybrid_groups(cp_group, ulysses_size)


def _check_hcp_groups(hcp_groups, cp_group, cp_size, ulysses_size, hq) -> tuple:
    if len(hcp_groups) != 2:
        raise ValueError(f"hcp_groups must be (a2a_group, ring_group), inner all-to-all group first; "
                         f"got {len(hcp_groups)} groups")
    a2a, ring = hcp_groups
    u, r = dist.get_world_size(a2a), dist.get_world_size(ring)
    if ulysses_size not in (None, u):
        raise ValueError(f"ulysses_size={ulysses_size} disagrees with the a2a group in hcp_groups (size {u})")
    expected = hybrid_ranks(dist.get_process_group_ranks(cp_group), dist.get_rank(cp_group), u)
    got = (dist.get_process_group_ranks(a2a), dist.get_process_group_ranks(ring))
    cp_rank = dist.get_rank(cp_group)
    positions = (dist.get_rank(a2a), dist.get_rank(ring)) == (cp_rank % u, cp_rank // u)
    if u * r != cp_size or [sorted(g) for g in got] != [sorted(g) for g in expected] or not positions:
        raise ValueError(
            f"hcp_groups (global ranks {got[0]} x {got[1]}) must split cp_group (size {cp_size}) as Megatron's "
            f"hierarchical_context_parallel_sizes do, inner all-to-all group first: expected {expected[0]} "
            f"x {expected[1]}"
        )
    if hq % u != 0:
        raise ValueError(f"the a2a group of hcp_groups (size {u}) must divide the query heads ({hq})")
    return a2a, ring


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
    mask = BlockMask(causal=causal, window=_check_window(window_size))
    check_divisible(seq_len, cp_size, "seq_len")
    layout = SeqLayout(cp_size, seq_len // (2 * cp_size), zigzag=zigzag)
    if algorithm == "ring":
        pairs = [ring_schedule(layout, mask).pairs(r) * heads for r in range(cp_size)]
    elif algorithm == "allgather":
        pairs = [sum(c.pairs for c in allgather_calls(layout, r, mask)) * heads for r in range(cp_size)]
    elif algorithm == "ulysses":
        pairs = [local_schedule(seq_len, mask).pairs(0) * heads // cp_size] * cp_size
    elif algorithm == "hybrid":
        u = ulysses_size or 1
        ring = ring_schedule(SeqLayout(cp_size // u, seq_len // (2 * cp_size // u), zigzag=zigzag), mask)
        pairs = [ring.pairs(r // u) * heads // u for r in range(cp_size)]
    else:
        raise ValueError(f"algorithm={algorithm!r} is not one of {ALGORITHMS}")
    return [2 * (d_qk + d_v) * batch * p for p in pairs]
