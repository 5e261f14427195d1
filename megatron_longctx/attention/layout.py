"""How a sequence of documents is laid out over the context-parallel ranks: one layout, dense or packed.

A packed sequence concatenates documents; document ``i`` holds ``cu_seqlens[i+1] - cu_seqlens[i]``
real tokens at the start of a slot of ``cu_seqlens_padded[i+1] - cu_seqlens_padded[i]`` tokens
(the rest of the slot is padding).  Both arrays are *global* offsets, the same on every rank, as
Megatron's ``PackedSeqParams`` carries them.  A dense ``[s, b, h, d]`` sequence is the packing of
one document of ``s`` tokens (:meth:`SeqLayout.dense`), so every algorithm is written once.

Per-document load balancing (Megatron-Core's zigzag, per document for THD as in Transformer Engine's
``thd_get_partitioned_indices``): every padded slot, a multiple of ``2*cp`` tokens, is cut into
``2*cp`` chunks of ``c_i = padded_i / (2*cp)`` tokens and rank ``r`` keeps chunks ``r`` and
``2*cp-1-r`` (:func:`.zigzag.zigzag_chunks`) of *every* document.  A rank's local tensor is, document
after document, its two chunks of that document; it holds ``padded_total / cp`` tokens.  Megatron's
RoPE slices positions the same way, so document-relative positions stay correct.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import typing
import weakref
from typing import Sequence

import torch

from .segments import Segment, Segments
from .zigzag import zigzag_chunks


# Host copies of offset tensors, keyed by the tensor: Megatron passes the same cu_seqlens tensors to every
# layer of a step, so a device tensor is copied to the host (one device sync) once, not once per layer.
_HOST: dict[int, tuple[weakref.ref, int, list[int]]] = {}  # id(tensor) -> (tensor, version, values)


def _cached(t: torch.Tensor) -> bool:
    entry = _HOST.get(id(t))
    return entry is not None and entry[0]() is t and entry[1] == t._version


def host_offsets(*tensors: torch.Tensor) -> list[list[int]]:
    """The values of 1-D integer ``tensors`` as host lists: one device-to-host transfer for those not yet
    cached; cached on each tensor object until it is modified in place (its version changes)."""
    todo = list({id(t): t for t in tensors if not _cached(t)}.values())
    if todo:
        flat = torch.cat([t.reshape(-1).to(torch.int64) for t in todo]).tolist()  # one transfer
        for t in todo:
            if id(t) not in _HOST:
                weakref.finalize(t, _HOST.pop, id(t), None)
            _HOST[id(t)], flat = (weakref.ref(t), t._version, flat[: t.numel()]), flat[t.numel():]
    return [_HOST[id(t)][2] for t in tensors]


def _as_offsets(name: str, values) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        shape = values.shape[1:] if values.dim() == 2 and values.shape[0] == 1 else values.shape  # [1, n]: a batch dim
        if len(shape) != 1 or values.dtype.is_floating_point:
            raise ValueError(f"{name} must be a 1-D integer tensor of offsets; got shape {tuple(values.shape)}, "
                             f"dtype {values.dtype}")
        values = host_offsets(values)[0]
    offsets = tuple(int(x) for x in values)
    if len(offsets) < 2:
        raise ValueError(f"{name}={list(offsets)} must hold at least two offsets [0, ..., total] (one document)")
    if offsets[0] != 0:
        raise ValueError(f"{name}={list(offsets)} must start at 0 (cumulative document lengths)")
    bad = [i for i in range(len(offsets) - 1) if offsets[i + 1] < offsets[i]]
    if bad:
        i = bad[0]
        raise ValueError(f"{name} must be non-decreasing (cumulative document lengths), but {name}[{i + 1}]="
                         f"{offsets[i + 1]} < {name}[{i}]={offsets[i]}")
    return offsets


@dataclasses.dataclass(frozen=True)
class Packing:
    """The documents of one packed sequence: global real offsets and global padded offsets.

    ``cu_seqlens`` ``(n_docs + 1,)``: cumulative real lengths (``cu_seqlens_q`` of Megatron's
    ``PackedSeqParams``).  ``cu_seqlens_padded``: cumulative slot lengths (``cu_seqlens_q_padded``);
    equal to ``cu_seqlens`` when documents carry no padding.  Real tokens come first in each slot.
    """

    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...]

    def __post_init__(self) -> None:
        real = _as_offsets("cu_seqlens", self.cu_seqlens)
        padded = _as_offsets("cu_seqlens_padded", self.cu_seqlens_padded)
        object.__setattr__(self, "cu_seqlens", real)
        object.__setattr__(self, "cu_seqlens_padded", padded)
        if len(real) != len(padded):
            raise ValueError(f"cu_seqlens ({len(real) - 1} documents) and cu_seqlens_padded ({len(padded) - 1} "
                             "documents) must describe the same documents")
        for i, (n, p) in enumerate(zip(self.lengths, self.padded_lengths)):
            if n > p:
                raise ValueError(f"document {i} has {n} tokens (cu_seqlens) but a slot of only {p} "
                                 f"(cu_seqlens_padded); each padded length must be >= the real length")

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens, cu_seqlens_padded=None) -> Packing:
        """From offsets (tensors or sequences of ints); ``cu_seqlens_padded=None`` means no padding."""
        return cls(cu_seqlens, cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded)

    @classmethod
    def from_lengths(cls, lengths: Sequence[int], cp_size: int) -> Packing:
        """Documents of ``lengths`` real tokens, each slot padded to the next multiple of ``2*cp_size``."""
        if cp_size < 1:
            raise ValueError(f"cp_size={cp_size} must be >= 1")
        if any(int(n) < 0 for n in lengths):
            raise ValueError(f"lengths={list(lengths)} must be >= 0")
        unit = 2 * cp_size
        padded = [-(-int(n) // unit) * unit for n in lengths]
        return cls(tuple(itertools.accumulate(lengths, initial=0)), tuple(itertools.accumulate(padded, initial=0)))

    @classmethod
    def from_packed_seq_params(cls, params) -> Packing:
        """From any object with Megatron ``PackedSeqParams``' fields (self-attention: q and kv must agree)."""
        real_q, real_kv = params.cu_seqlens_q, params.cu_seqlens_kv
        pad_q = getattr(params, "cu_seqlens_q_padded", None)
        pad_kv = getattr(params, "cu_seqlens_kv_padded", None)
        packing = cls.from_cu_seqlens(real_q, pad_q)
        if real_kv is not None and cls.from_cu_seqlens(real_kv, pad_kv) != packing:
            raise ValueError("packed self-attention needs cu_seqlens_kv(_padded) equal to cu_seqlens_q(_padded); "
                             "cross-attention over packed sequences is not supported")
        return packing

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.cu_seqlens, self.cu_seqlens[1:]))

    @property
    def padded_lengths(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.cu_seqlens_padded, self.cu_seqlens_padded[1:]))

    @property
    def total(self) -> int:
        """Real tokens of the packed sequence."""
        return self.cu_seqlens[-1]

    @property
    def padded_total(self) -> int:
        """Tokens of the padded packed sequence (what the model's sequence dim holds before sharding)."""
        return self.cu_seqlens_padded[-1]

    def check_cp(self, cp_size: int) -> None:
        """Raise ``ValueError`` unless every padded slot splits into ``2*cp_size`` equal chunks."""
        unit = 2 * cp_size
        bad = [(i, p) for i, p in enumerate(self.padded_lengths) if p % unit != 0]
        if bad:
            i, p = bad[0]
            raise ValueError(
                f"document {i} has a padded length of {p} (cu_seqlens_padded), not a multiple of 2*cp={unit}: "
                f"per-document load balancing cuts each document into 2*cp chunks; pad every document to a "
                f"multiple of {unit} (Packing.from_lengths(lengths, cp_size) does) and pass cu_seqlens_padded"
            )


@dataclasses.dataclass(frozen=True)
class SeqLayout:
    """Which tokens of each document each of ``cp_size`` ranks holds (per-document zigzag).

    ``zigzag=False``: naive contiguous sharding (rank ``r`` holds chunks ``2r`` and ``2r+1``), kept to
    price the load imbalance (schedules only; no data moves in that layout).  ``cp_size == 1``: one
    rank holds every document whole, whatever its length.
    """

    packing: Packing
    cp_size: int
    zigzag: bool = True

    def __post_init__(self) -> None:
        if self.cp_size < 1:
            raise ValueError(f"cp_size={self.cp_size} must be >= 1")
        if self.cp_size > 1:
            self.packing.check_cp(self.cp_size)

    @classmethod
    def dense(cls, seq_len: int, cp_size: int, zigzag: bool = True) -> SeqLayout:
        """One document of ``seq_len`` tokens (a dense sequence), over ``cp_size`` ranks."""
        return cls(Packing((0, seq_len), (0, seq_len)), cp_size, zigzag)

    @property
    def num_docs(self) -> int:
        return self.packing.num_docs

    @property
    def global_len(self) -> int:
        return self.packing.padded_total

    @property
    def local_len(self) -> int:
        return self.packing.padded_total // self.cp_size

    def chunk(self, doc: int) -> int:
        """Tokens per chunk of document ``doc`` (``padded / (2*cp)``)."""
        return self.packing.padded_lengths[doc] // (2 * self.cp_size)

    @functools.cached_property
    def local_starts(self) -> tuple[int, ...]:
        """Offset of each document's tokens in a rank's local tensor, plus ``local_len`` at the end."""
        return tuple(itertools.accumulate((p // self.cp_size for p in self.packing.padded_lengths), initial=0))

    def segments(self, doc: int, rank: int) -> Segments:
        """Real tokens of ``doc`` on ``rank`` as document-relative segments, in local memory order.

        Chunk ``rank`` comes first, chunk ``2*cp-1-rank`` second; each is clipped to the document's
        real length and dropped when nothing real is left.  Only the last kept segment can be
        clipped (the real tokens of a slot come first), so the local offset of each segment is the
        sum of the lengths before it, as :func:`.segments.schedule_blocks` assumes.
        """
        n = self.packing.lengths[doc]
        if self.cp_size == 1:
            return (Segment(0, n),) if n > 0 else ()
        c = self.chunk(doc)
        runs = [(j * c, c) for j in zigzag_chunks(rank, self.cp_size)] if self.zigzag else [(2 * rank * c, 2 * c)]
        return tuple(Segment(start, min(length, n - start)) for start, length in runs if n - start > 0)

    def coarsen(self, group_size: int) -> SeqLayout:
        """The layout seen by groups of ``group_size`` consecutive ranks that pool their tokens.

        Ranks ``g*U .. g*U+U-1`` hold, together, chunks ``g`` and ``2*cp/U-1-g`` of each document
        when chunks are ``U`` times longer: the layout of ``cp/U`` ranks.  ``group_size == cp`` gives
        one rank holding the natural sequence.
        """
        if group_size < 1 or self.cp_size % group_size != 0:
            raise ValueError(f"group_size={group_size} must divide cp_size={self.cp_size}")
        return SeqLayout(self.packing, self.cp_size // group_size, self.zigzag)


def dense_layout(cp_size: int, chunk: int, zigzag: bool = True) -> SeqLayout:
    """One dense sequence of ``2*cp_size*chunk`` tokens over ``cp_size`` ranks."""
    return SeqLayout.dense(2 * cp_size * chunk, cp_size, zigzag)


def _doc_tensors(layout: SeqLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per document: padded start in the packed sequence, chunk length, start in a local shard."""
    starts = torch.tensor(layout.packing.cu_seqlens_padded[:-1], dtype=torch.int64)
    chunks = torch.tensor([layout.chunk(d) for d in range(layout.packing.num_docs)], dtype=torch.int64)
    local_starts = torch.tensor(layout.local_starts[:-1], dtype=torch.int64)
    return starts, chunks, local_starts


def _require_zigzag(layout: SeqLayout) -> None:
    if not layout.zigzag:
        raise ValueError("tokens move only in the zigzag layout; zigzag=False prices schedules only")


@functools.lru_cache(maxsize=16)
def _partition_index(layout: SeqLayout, rank: int, device: str) -> torch.Tensor:
    _require_zigzag(layout)
    if layout.cp_size == 1:
        return torch.arange(layout.local_len, device=device)
    starts, chunks, local_starts = _doc_tensors(layout)
    doc = torch.repeat_interleave(torch.arange(len(chunks)), 2 * chunks)  # [t/cp]: document of each local token
    within = torch.arange(layout.local_len) - local_starts[doc]  # offset inside the document's two chunks
    c = chunks[doc]
    second = within >= c
    first_chunk, second_chunk = zigzag_chunks(rank, layout.cp_size)
    chunk = torch.where(second, second_chunk, first_chunk)
    return (starts[doc] + chunk * c + within - second * c).to(device)  # [t/cp]


def partition_index(layout: SeqLayout, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions in the padded packed sequence of ``rank``'s local tokens, in local order ``[t/cp]`` (int64).

    The same indices as Transformer Engine's ``thd_get_partitioned_indices(cu_seqlens_padded,
    padded_total, cp, rank)``, computed without it.  Cached per (layout, rank, device): do not modify.
    """
    if not 0 <= rank < layout.cp_size:
        raise ValueError(f"cp_rank={rank} must lie in [0, cp_size={layout.cp_size})")
    return _partition_index(layout, rank, str(torch.device(device)))


@functools.lru_cache(maxsize=16)
def _group_order(layout: SeqLayout, group_size: int, device: str) -> torch.Tensor:
    u = group_size
    _require_zigzag(layout)
    if u == 1:
        return torch.arange(layout.local_len, device=device)
    coarse = layout.coarsen(u)
    _, chunks, fine_starts = _doc_tensors(layout)
    doc = torch.repeat_interleave(torch.arange(len(chunks)), 2 * u * chunks)  # [U*t/cp]: document of each token
    within = torch.arange(coarse.local_len) - torch.tensor(coarse.local_starts[:-1], dtype=torch.int64)[doc]
    c = chunks[doc]
    second = within >= u * c  # the coarse chunk 2cp/U-1-g (members' second halves, last member first)
    w = within - second * u * c
    member = torch.where(second, u - 1 - w // c, w // c)
    return (member * layout.local_len + fine_starts[doc] + second * c + w % c).to(device)  # [U*t/cp]


def group_order(layout: SeqLayout, group_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Index that turns ``group_size`` consecutive ranks' pooled shards into their coarse shard.

    Input: the local tensors of ranks ``gU .. gU+U-1`` concatenated in rank order ``[U*t/cp]``;
    ``pooled[order]`` is shard ``g`` of :meth:`SeqLayout.coarsen` ``(U)``, the same index for
    every ``g``.  With ``U = cp`` it yields the natural padded packed sequence.  Cached per
    (layout, U, device): do not modify.
    """
    return _group_order(layout, group_size, str(torch.device(device)))


class PooledIndex(typing.NamedTuple):
    """Where each token of a coarse shard comes from: member rank and local token ``[U*t/cp]`` each, and the
    same as runs of consecutive tokens of one member, ``(member, first local token, first coarse token,
    length)``."""

    member: torch.Tensor
    token: torch.Tensor
    runs: tuple[tuple[int, int, int, int], ...]


# Runs up to which :func:`from_ranks` / :func:`to_ranks` copy run by run (one slice copy each, several times
# faster than a gather over every token); more runs (many short documents) take one indexed copy.
MAX_COPY_RUNS = 64


@functools.lru_cache(maxsize=16)
def _pooled_index(layout: SeqLayout, group_size: int, device: str) -> PooledIndex:
    order = _group_order(layout, group_size, device)
    member, token = order // layout.local_len, order % layout.local_len  # [U*t/cp] each
    m, t = member.cpu(), token.cpu()
    ends_run = (m.diff() != 0) | (t.diff() != 1)  # the next token is not the next one of the same member
    breaks = (torch.nonzero(ends_run).flatten() + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, m.numel()]
    runs = tuple((int(m[a]), int(t[a]), a, b - a) for a, b in zip(starts, ends))
    return PooledIndex(member, token, runs)


def pooled_index(layout: SeqLayout, group_size: int, device: torch.device | str = "cpu") -> PooledIndex:
    """:func:`group_order` split into (member rank, local token) ``[U*t/cp]`` each and into runs, for
    :func:`from_ranks` and :func:`to_ranks`."""
    return _pooled_index(layout, group_size, str(torch.device(device)))


def from_ranks(x: torch.Tensor, index: PooledIndex) -> torch.Tensor:
    """``[U, b, t, *rest]`` (one shard per member rank) -> the coarse shard ``[b, U*t, *rest]``.

    ``index``: :func:`pooled_index`.  One copy whatever ``b``: run by run, or one gather (member and
    token indexed together) past :data:`MAX_COPY_RUNS` runs.
    """
    if len(index.runs) > MAX_COPY_RUNS:
        return x.transpose(0, 1)[:, index.member, index.token]  # [b, U*t, *rest]
    out = x.new_empty(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])  # [b, U*t, *rest]
    for member, src, dst, n in index.runs:
        out[:, dst:dst + n] = x[member, :, src:src + n]
    return out


def to_ranks(y: torch.Tensor, u: int, index: PooledIndex,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`from_ranks`: ``[b, U*t, *rest]`` -> ``[U, b, t, *rest]`` (contiguous, or written into
    ``out`` of that shape, e.g. a view of a larger message)."""
    per_rank = y.new_empty(u, y.shape[0], y.shape[1] // u, *y.shape[2:]) if out is None else out  # [U, b, t, *rest]
    if len(index.runs) > MAX_COPY_RUNS:
        per_rank.transpose(0, 1)[:, index.member, index.token] = y  # one scatter copy
        return per_rank
    for member, src, dst, n in index.runs:
        per_rank[member, :, src:src + n] = y[:, dst:dst + n]
    return per_rank
