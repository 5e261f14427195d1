"""Shard a packed (THD) batch over the context-parallel ranks, and gather it back.

Per-document zigzag (:mod:`.layout`): rank ``r`` keeps chunks ``r`` and ``2cp-1-r`` of every
document's padded slot, the split of Megatron-Core's per-document THD balancing
(``get_batch_on_this_cp_rank`` with ``cu_seqlens``; Transformer Engine's
``thd_get_partitioned_indices``), computed here on the host without Transformer Engine.

Tensors are in the *padded* packed layout (``cu_seqlens_padded[-1]`` tokens along the sequence dim);
:func:`pad_packed` turns the real layout (``cu_seqlens[-1]`` tokens) into it.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch
import torch.distributed as dist

from .layout import Packing, SeqLayout, partition_index


def _check_len(x: torch.Tensor, seq_dim: int, expected: int, name: str, what: str) -> None:
    if x.shape[seq_dim] != expected:
        raise ValueError(f"{name}.shape[{seq_dim}]={x.shape[seq_dim]} must equal {what}={expected}")


def _real_index(packing: Packing) -> torch.Tensor:
    """Positions of the real tokens in the padded packed sequence ``[cu_seqlens[-1]]``."""
    starts = torch.tensor(packing.cu_seqlens_padded[:-1], dtype=torch.int64)
    lengths = torch.tensor(packing.lengths, dtype=torch.int64)
    doc_of = torch.repeat_interleave(torch.arange(packing.num_docs), lengths)  # [total]
    within = torch.arange(packing.total) - torch.tensor(packing.cu_seqlens[:-1])[doc_of]
    return starts[doc_of] + within


def pad_packed(x: torch.Tensor, packing: Packing, seq_dim: int = 0, value: float = 0) -> torch.Tensor:
    """Real packed ``x`` (``cu_seqlens[-1]`` tokens along ``seq_dim``) -> padded (``cu_seqlens_padded[-1]``)."""
    _check_len(x, seq_dim, packing.total, "x", "cu_seqlens[-1]")
    shape = list(x.shape)
    shape[seq_dim] = packing.padded_total
    out = x.new_full(shape, value)
    return out.index_copy_(seq_dim, _real_index(packing).to(x.device), x)


def unpad_packed(x: torch.Tensor, packing: Packing, seq_dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`pad_packed`: drop the padding tokens."""
    _check_len(x, seq_dim, packing.padded_total, "x", "cu_seqlens_padded[-1]")
    return x.index_select(seq_dim, _real_index(packing).to(x.device))


def real_token_mask(packing: Packing) -> torch.Tensor:
    """Bool ``[cu_seqlens_padded[-1]]``: True on real tokens, False on padding."""
    mask = torch.zeros(packing.padded_total, dtype=torch.bool)
    mask[_real_index(packing)] = True
    return mask


def packed_position_ids(packing: Packing) -> torch.Tensor:
    """Document-relative positions ``[cu_seqlens_padded[-1]]`` (0 at each document start, padding included)."""
    lengths = torch.tensor(packing.padded_lengths, dtype=torch.int64)
    starts = torch.tensor(packing.cu_seqlens_padded[:-1], dtype=torch.int64)
    return torch.arange(packing.padded_total) - torch.repeat_interleave(starts, lengths)


def shard_packed(x: torch.Tensor, packing: Packing, cp_rank: int, cp_size: int, seq_dim: int = 0) -> torch.Tensor:
    """This rank's tokens of the padded packed ``x``: chunks ``cp_rank`` and ``2cp-1-cp_rank`` of each document.

    ``x`` ``[..., cu_seqlens_padded[-1], ...]`` -> ``[..., cu_seqlens_padded[-1]/cp, ...]``.
    """
    layout = SeqLayout(packing, cp_size)
    _check_len(x, seq_dim, packing.padded_total, "x", "cu_seqlens_padded[-1]")
    return x.index_select(seq_dim, partition_index(layout, cp_rank, x.device))


def gather_packed_shards(shards: list[torch.Tensor], packing: Packing, seq_dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`shard_packed` given every rank's shard (rank order) -> the padded packed tensor."""
    layout = SeqLayout(packing, len(shards))
    for r, s in enumerate(shards):
        _check_len(s, seq_dim, layout.local_len, f"shards[{r}]", "cu_seqlens_padded[-1]/cp")
    index = torch.cat([partition_index(layout, r) for r in range(len(shards))]).to(shards[0].device)
    pooled = torch.cat(shards, dim=seq_dim)  # rank-major
    return torch.empty_like(pooled).index_copy_(seq_dim, index, pooled)


def unshard_packed(x_local: torch.Tensor, packing: Packing, cp_group: dist.ProcessGroup | None,
                   seq_dim: int = 0) -> torch.Tensor:
    """All-gather the shards of ``cp_group`` and undo :func:`shard_packed` (not differentiable; for checks)."""
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if cp_size == 1:
        return x_local
    shards = [torch.empty_like(x_local) for _ in range(cp_size)]
    dist.all_gather(shards, x_local.contiguous(), group=cp_group)  # cp x [..., t/cp, ...]
    return gather_packed_shards(shards, packing, seq_dim)


@dataclasses.dataclass
class PackedSeqFields:
    """The fields of Megatron-Core's ``PackedSeqParams`` that THD attention and RoPE read.

    ``PackedSeqParams(**dataclasses.asdict(fields))`` builds the Megatron object (in Megatron-facing
    code).  Offsets are *global* (unsharded), int32, identical on every CP rank, as Megatron passes them.
    """

    qkv_format: str
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor
    cu_seqlens_kv_padded: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int


def packed_seq_fields(packing: Packing, device: torch.device | str = "cpu") -> PackedSeqFields:
    """``PackedSeqParams`` fields for ``packing`` (max lengths are the largest padded slot)."""
    real = torch.tensor(packing.cu_seqlens, dtype=torch.int32, device=device)
    padded = torch.tensor(packing.cu_seqlens_padded, dtype=torch.int32, device=device)
    longest = max(packing.padded_lengths)
    return PackedSeqFields("thd", real, real.clone(), padded, padded.clone(), longest, longest)


SEQUENCE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def packed_batch_on_this_cp_rank(
    batch: Mapping[str, torch.Tensor | None], packing: Packing, cp_rank: int, cp_size: int, seq_dim: int = 1
) -> tuple[dict[str, torch.Tensor | None], PackedSeqFields]:
    """This rank's part of a padded packed batch, and the ``PackedSeqParams`` fields every rank passes on.

    ``batch``: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` ``[1, cu_seqlens_padded[-1]]``
    (Megatron's flattened THD batch, ``seq_dim=1``; any may be None).  A missing ``position_ids``
    becomes document-relative positions; ``loss_mask`` (ones if missing) is zeroed on padding.  Other
    keys pass through unchanged.  Returns tensors with ``cu_seqlens_padded[-1]/cp`` tokens.
    """
    ref = next((batch[k] for k in SEQUENCE_KEYS if batch.get(k) is not None), None)
    if ref is None:
        raise ValueError(f"batch has none of {SEQUENCE_KEYS}")
    out = dict(batch)
    shape = [1] * ref.dim()
    shape[seq_dim] = packing.padded_total
    if out.get("position_ids") is None:
        out["position_ids"] = packed_position_ids(packing).view(shape).to(ref.device)
    real = real_token_mask(packing).view(shape).to(ref.device)
    loss_mask = out.get("loss_mask")
    out["loss_mask"] = real.float() if loss_mask is None else loss_mask * real.to(loss_mask.dtype)
    for key in SEQUENCE_KEYS:
        if out.get(key) is not None:
            out[key] = shard_packed(out[key], packing, cp_rank, cp_size, seq_dim)
    return out, packed_seq_fields(packing, ref.device)
