"""Megatron's load-balanced ("zigzag") sequence layout for context parallelism.

The global sequence is cut into ``2*cp`` chunks of ``c`` tokens; rank ``r`` holds chunks ``r`` and
``2*cp-1-r`` concatenated, which gives every rank the same amount of causal attention work.  This
is what Megatron-Core's ``get_batch_on_this_cp_rank`` and ``get_pos_emb_on_this_cp_rank`` produce
(Megatron-LM, context parallelism; the same layout as ring-flash-attention's zigzag ring).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

from .segments import Segment, Segments


@dataclasses.dataclass(frozen=True)
class SeqLayout:
    """Which global positions each of ``cp_size`` ranks holds, in chunks of ``chunk`` tokens.

    ``zigzag=True``: Megatron's layout above.  ``zigzag=False``: naive contiguous sharding (rank
    ``r`` holds ``[2rc, 2(r+1)c)``), kept for the load-balance benchmark.
    """

    cp_size: int
    chunk: int
    zigzag: bool = True

    @property
    def local_len(self) -> int:
        return 2 * self.chunk

    @property
    def global_len(self) -> int:
        return 2 * self.cp_size * self.chunk

    def segments(self, rank: int) -> Segments:
        c = self.chunk
        if not self.zigzag:
            return (Segment(2 * rank * c, 2 * c),)
        return (Segment(rank * c, c), Segment((2 * self.cp_size - 1 - rank) * c, c))


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
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


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
    order = [halves[r][0] for r in range(cp_size)] + [halves[r][1] for r in reversed(range(cp_size))]
    return torch.cat(order, dim=seq_dim)  # [..., s, ...]


@functools.lru_cache(maxsize=64)
def _natural_index(cp_size: int) -> tuple[list[int], list[int]]:
    """For natural chunk ``g``: the rank holding it and which half of that rank's shard it is."""
    ranks = list(range(cp_size)) + list(reversed(range(cp_size)))
    halves = [0] * cp_size + [1] * cp_size
    return ranks, halves


def ranks_to_natural(x: torch.Tensor) -> torch.Tensor:
    """Reorder every rank's shard into the natural sequence.

    ``x`` ``[cp, b, s/cp, *rest]`` (rank-major, each rank's zigzag shard) -> ``[b, s, *rest]``.
    """
    cp, b, s_local = x.shape[:3]
    rest = x.shape[3:]
    ranks, halves = _natural_index(cp)
    chunks = x.view(cp, b, 2, s_local // 2, *rest).transpose(0, 1)  # [b, cp, 2, c, *rest]
    natural = chunks[:, ranks, halves]  # [b, 2cp, c, *rest]
    return natural.view(b, cp * s_local, *rest)


def natural_to_ranks(y: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Inverse of :func:`ranks_to_natural`: ``[b, s, *rest]`` -> ``[cp, b, s/cp, *rest]`` (contiguous)."""
    b, s = y.shape[:2]
    rest = y.shape[2:]
    c = s // (2 * cp_size)
    # Natural chunk of (rank r, half h): r for h = 0, 2cp-1-r for h = 1.
    order = [r if h == 0 else 2 * cp_size - 1 - r for r in range(cp_size) for h in (0, 1)]
    chunks = y.reshape(b, 2 * cp_size, c, *rest).transpose(0, 1)  # [2cp, b, c, *rest]
    per_rank = chunks[order]  # [2cp, b, c, *rest] in (rank, half) order
    per_rank = per_rank.view(cp_size, 2, b, c, *rest).transpose(1, 2)  # [cp, b, 2, c, *rest]
    return per_rank.reshape(cp_size, b, 2 * c, *rest)  # copies only when b > 1
