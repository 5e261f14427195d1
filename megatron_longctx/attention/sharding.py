"""Shard a dense sequence in Megatron's load-balanced ("zigzag") layout, and gather it back.

The global sequence is cut into ``2*cp`` chunks of ``c`` tokens; rank ``r`` holds chunks ``r`` and
``2*cp-1-r`` concatenated (:mod:`.zigzag`), which gives every rank the same amount of causal
attention work (the schedules see it as a :class:`.layout.SeqLayout` of one document).  This is
what Megatron-Core's ``get_batch_on_this_cp_rank`` and ``get_pos_emb_on_this_cp_rank`` produce
(Megatron-LM, context parallelism; the same layout as ring-flash-attention's zigzag ring).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .zigzag import chunk_owners, zigzag_chunks


def check_divisible(seq_len: int, cp_size: int, name: str = "seq_len") -> None:
    """Raise ``ValueError`` unless ``seq_len`` splits into ``2*cp_size`` equal chunks."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"{name}={seq_len} must be divisible by 2*cp_size={2 * cp_size} (the load-balanced layout "
            f"cuts the sequence into 2*cp chunks); pad the sequence to a multiple of {2 * cp_size}"
        )


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int) -> torch.Tensor:
    """This rank's shard of the global tensor ``x``: chunks ``cp_rank`` and ``2*cp_size-1-cp_rank``.

    ``x`` holds the whole sequence along ``seq_dim`` (e.g. ``[s, b, h, d]`` with ``seq_dim=0``);
    returns the ``s/cp_size`` local tokens along the same dim.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must lie in [0, cp_size={cp_size})")
    check_divisible(x.shape[seq_dim], cp_size, "x.shape[seq_dim]")
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[j] for j in zigzag_chunks(cp_rank, cp_size)], dim=seq_dim)


def unshard_sequence(x_local: torch.Tensor, cp_group: dist.ProcessGroup | None, seq_dim: int) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: all-gather the shards of ``cp_group`` in natural order.

    ``x_local`` ``[..., s/cp, ...]`` (same shape on every rank) -> ``[..., s, ...]``.  Not
    differentiable; meant for checks and evaluation.
    """
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if cp_size == 1:
        return x_local
    check_divisible(x_local.shape[seq_dim] * cp_size, cp_size, "x_local.shape[seq_dim] * cp_size")
    shards = [torch.empty_like(x_local) for _ in range(cp_size)]
    dist.all_gather(shards, x_local.contiguous(), group=cp_group)  # cp x [..., s/cp, ...]
    halves = [shard.chunk(2, dim=seq_dim) for shard in shards]
    return torch.cat([halves[r][h] for r, h in chunk_owners(cp_size)], dim=seq_dim)  # [..., s, ...]
