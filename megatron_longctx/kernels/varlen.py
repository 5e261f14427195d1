"""Many blocks in one call: the blocks of one ring step (every document of a packed batch) as few
variable-length kernel calls.

A packed (THD) batch gives each ring step one block per document.  :func:`forward_blocks` and
:func:`backward_blocks` take all of them at once.  A backend with a variable-length entry point
(``cu_seqlens``: torch's flash ops, as ``torch.nn.attention.varlen`` calls them) serves them with one
call per *kind* of piece (unmasked, causal, one window: :meth:`~.base.LiveBlock.flash_window`), the
query and key rows of every piece of that kind laid end to end; any other backend loops over the
blocks inside (one call from the algorithm's point of view, the same kernels as block by block).

Each block's result comes back as that backend's single-block call would return it: out
``[b, s_q, h_q, d_v]`` and lse ``[b, h_q, s_q]`` over the block's rows (rows outside every piece
``0``/``-inf``), gradients shaped like the block's q, k and v.  Sequence lengths come from the
blocks (host integers of the cached schedule): nothing is read back from the device, and the ``cu_seqlens``
of a new packing go up from pinned memory without a host wait (:class:`HostCopies`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import torch

from .base import BlockArgs, LiveBlock, accumulator_dtype
from .driver import empty_result, pad_head_dim, padded_head_dim, zero_grads


@dataclasses.dataclass(frozen=True)
class Block:
    """Query rows ``[q_lo, q_hi)`` against key rows ``[k_lo, k_hi)`` of the tensors passed along."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    args: BlockArgs


def forward_blocks(backend, q, k, v, blocks: Sequence[Block]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``backend``'s (out, lse) of every block, in order (its own many-block entry point if it has one)."""
    many = getattr(backend, "forward_blocks", None)
    if many is not None:
        return many(q, k, v, blocks)
    return [backend.forward(q[:, b.q_lo:b.q_hi], k[:, b.k_lo:b.k_hi], v[:, b.k_lo:b.k_hi], b.args) for b in blocks]


def backward_blocks(backend, dout, q, k, v, out, lse, blocks: Sequence[Block]) -> list[tuple[torch.Tensor, ...]]:
    """``backend``'s (dq, dk, dv) of every block given the final ``out``/``lse`` of all rows."""
    many = getattr(backend, "backward_blocks", None)
    if many is not None:
        return many(dout, q, k, v, out, lse, blocks)
    grads = []
    for b in blocks:
        rows, keys = slice(b.q_lo, b.q_hi), slice(b.k_lo, b.k_hi)
        grads.append(backend.backward(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows],
                                      lse[:, :, rows].contiguous(), b.args))
    return grads


@dataclasses.dataclass(frozen=True)
class _Seq:
    """One piece of block ``block`` as one sequence of a variable-length call (rows of the whole tensors)."""

    block: int
    piece: LiveBlock
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int


PiecesFn = Callable[[BlockArgs, int, int], list]


def group_pieces(blocks: Sequence[Block], pieces_for: PiecesFn) -> dict[tuple[bool, int, int], list[_Seq]]:
    """Every block's pieces (``pieces_for(args, s_q, s_k)``) grouped by their mask kind
    (:meth:`~.base.LiveBlock.flash_window`), in block order within a kind."""
    groups: dict[tuple[bool, int, int], list[_Seq]] = {}
    for i, b in enumerate(blocks):
        for p in pieces_for(b.args, b.q_hi - b.q_lo, b.k_hi - b.k_lo):
            groups.setdefault(p.flash_window(), []).append(
                _Seq(i, p, b.q_lo + p.q_lo, b.q_lo + p.q_hi, b.k_lo + p.k_lo, b.k_lo + p.k_hi))
    return groups


def _packed(x: torch.Tensor, ranges: list[tuple[int, int]], d: int) -> torch.Tensor:
    """Rows ``ranges`` of ``x`` ``[b, s, h, e]`` end to end, head dim padded to ``d``: ``[b * T, h, d]``
    (batch-major; a view when the ranges are one contiguous run and no padding is needed)."""
    runs: list[list[int]] = []
    for lo, hi in ranges:
        if runs and runs[-1][1] == lo:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi])
    parts = [x[:, lo:hi] for lo, hi in runs]
    y = pad_head_dim(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1), d)
    return y.reshape(-1, *y.shape[2:])


class HostCopies:
    """How the host integers of a packed call (``cu_seqlens``, lse rows) reach the device: built in pinned
    memory and copied without a host wait (``non_blocking``), so a new packing never stalls the CPU behind
    the compute stream.  Tests substitute a recorder with the same two methods."""

    @staticmethod
    def pin(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.pin_memory() if device.type == "cuda" else t

    @staticmethod
    def copy(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
        return t.to(device, non_blocking=non_blocking)


COPIES = HostCopies()


def _upload(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = COPIES.pin(torch.tensor(values, dtype=dtype), device)
    return COPIES.copy(host, device, non_blocking=True)


@functools.lru_cache(maxsize=256)
def _cu_seqlens(lengths: tuple[int, ...], batch: int, device: torch.device) -> torch.Tensor:
    """int32 ``cu_seqlens`` of ``lengths`` repeated for each batch row (batch-major), on ``device``.

    Cached: a step's lengths come from the cached schedule, so each layer and micro-batch reuses the
    tensor the first one moved to the device (host values in, nothing read back)."""
    cu, total = [0], 0
    for _ in range(batch):
        for n in lengths:
            total += n
            cu.append(total)
    return _upload(cu, torch.int32, device)


@functools.lru_cache(maxsize=256)
def _padded_rows(lengths: tuple[int, ...], batch: int, device: torch.device) -> torch.Tensor:
    """int64 ``[T]``: where row ``t`` of the packed rows sits in a per-sequence padded ``[n, max_len]`` grid."""
    width = max(lengths)
    index = [i * width + j for i, n in enumerate(lengths * batch) for j in range(n)]
    return _upload(index, torch.int64, device)


@dataclasses.dataclass(frozen=True)
class VarlenSeqs:
    """One variable-length call's sequences: ``cu_q``/``cu_k`` (int32, on the device), the longest of each,
    the per-sequence query lengths (host integers, batch-major), the softmax scale and the mask kind
    (:meth:`~.base.LiveBlock.flash_window`)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    lengths_q: tuple[int, ...]
    scale: float
    kind: tuple[bool, int, int]

    def padded_rows(self) -> torch.Tensor:
        """int64 ``[T]`` index of each packed query row in a ``[sequences, max_q]`` grid (cached on the device)."""
        return _padded_rows(self.lengths_q, 1, self.cu_q.device)

    def lse_from_padded(self, lse: torch.Tensor) -> torch.Tensor:
        """lse ``[n, h, max_q]`` (per sequence, padded: flash-attn < 2.6) -> ``[h, T]``."""
        h = lse.shape[1]
        return lse.transpose(0, 1).reshape(h, -1)[:, self.padded_rows()]  # [h, n * max_q] -> [h, T]

    def lse_to_padded(self, lse: torch.Tensor) -> torch.Tensor:
        """lse ``[h, T]`` -> ``[n, h, max_q]`` (rows past a sequence's end 0), contiguous."""
        h, n = lse.shape[0], len(self.lengths_q)
        grid = lse.new_zeros(h, n * self.max_q)
        grid[:, self.padded_rows()] = lse
        return grid.view(h, n, self.max_q).transpose(0, 1).contiguous()  # [n, h, max_q]


class _Kinds:
    """The blocks' pieces grouped by kind, packed for one variable-length call per kind."""

    def __init__(self, blocks: Sequence[Block], pieces_for: PiecesFn, q: torch.Tensor, v: torch.Tensor,
                 head_multiple: int):
        self.blocks = blocks
        self.groups = group_pieces(blocks, pieces_for)
        self.d = padded_head_dim(q.shape[-1], v.shape[-1], head_multiple)
        self.batch = q.shape[0]
        per_block: dict[int, list[_Seq]] = {}
        for seqs in self.groups.values():
            for s in seqs:
                per_block.setdefault(s.block, []).append(s)
        # a block served by one piece over all its rows and keys takes the kernel's tensors as they are
        self.whole = {i for i, seqs in per_block.items() if len(seqs) == 1 and (
            seqs[0].q_lo, seqs[0].q_hi, seqs[0].k_lo, seqs[0].k_hi) == (
            blocks[i].q_lo, blocks[i].q_hi, blocks[i].k_lo, blocks[i].k_hi)}

    def seqs(self, kind, seqs: list[_Seq], device) -> VarlenSeqs:
        len_q, len_k = tuple(s.q_hi - s.q_lo for s in seqs), tuple(s.k_hi - s.k_lo for s in seqs)
        return VarlenSeqs(_cu_seqlens(len_q, self.batch, device), _cu_seqlens(len_k, self.batch, device),
                          max(len_q), max(len_k), len_q * self.batch, self.blocks[seqs[0].block].args.softmax_scale,
                          kind)


def _start(blocks: Sequence[Block], pieces_for: PiecesFn, q, v, head_multiple: int, partial) -> tuple[_Kinds, list]:
    """The blocks' kinds, and one result per block: ``partial(block)`` (filled piece by piece) where the block
    is served in pieces, None (set from its whole call) where it is served whole."""
    kinds = _Kinds(blocks, pieces_for, q, v, head_multiple)
    return kinds, [None if i in kinds.whole else partial(blk) for i, blk in enumerate(blocks)]


def varlen_forward(call, q, k, v, blocks: Sequence[Block], pieces_for: PiecesFn, head_multiple: int):
    """(out, lse) of every block through ``call(q, k, v, seqs: VarlenSeqs)``, one call per kind: q
    ``[T, h_q, D]``, k/v ``[T_k, h_kv, D]`` → out ``[T, h_q, D]``, lse ``[h_q, T]``."""
    b, _, h_q, _ = q.shape
    d_v = v.shape[-1]
    kinds, results = _start(blocks, pieces_for, q, v, head_multiple,
                            lambda blk: empty_result(q, blk.q_hi - blk.q_lo, d_v))
    for kind, seqs in kinds.groups.items():
        qp = _packed(q, [(s.q_lo, s.q_hi) for s in seqs], kinds.d)
        kp = _packed(k, [(s.k_lo, s.k_hi) for s in seqs], kinds.d)
        vp = _packed(v, [(s.k_lo, s.k_hi) for s in seqs], kinds.d)
        out, lse = call(qp, kp, vp, kinds.seqs(kind, seqs, q.device))
        total = out.shape[0] // b
        out = out.view(b, total, h_q, kinds.d)[..., :d_v]  # [b, T, h_q, d_v]
        lse = lse.view(h_q, b, total).transpose(0, 1)  # [b, h_q, T]
        at = 0
        for s in seqs:
            n = s.q_hi - s.q_lo
            o, l = out[:, at:at + n], lse[:, :, at:at + n]
            at += n
            if s.block in kinds.whole:
                results[s.block] = (o, l.to(accumulator_dtype(q)))
                continue
            rows = slice(s.piece.q_lo, s.piece.q_hi)
            results[s.block][0][:, rows] = o
            results[s.block][1][:, :, rows] = l
    return results


def varlen_backward(call, dout, q, k, v, out, lse, blocks: Sequence[Block], pieces_for: PiecesFn, head_multiple: int):
    """(dq, dk, dv) of every block through ``call(dout, q, k, v, out, lse, seqs: VarlenSeqs)`` (packed like
    :func:`varlen_forward`; lse ``[h_q, T]``), one call per kind."""
    b, _, h_q, d_qk = q.shape
    d_v = v.shape[-1]
    kinds, grads = _start(blocks, pieces_for, q, v, head_multiple,
                          lambda blk: zero_grads(q, k, v, blk.q_hi - blk.q_lo, blk.k_hi - blk.k_lo))
    lse = lse.to(accumulator_dtype(q))
    for kind, seqs in kinds.groups.items():
        q_rows, k_rows = [(s.q_lo, s.q_hi) for s in seqs], [(s.k_lo, s.k_hi) for s in seqs]
        lse_p = torch.cat([lse[:, :, lo:hi] for lo, hi in q_rows], dim=-1)  # [b, h_q, T]
        lse_p = lse_p.transpose(0, 1).reshape(h_q, -1).contiguous()  # [h_q, b*T]
        dq, dk, dv = call(_packed(dout.to(q.dtype), q_rows, kinds.d), _packed(q, q_rows, kinds.d),
                          _packed(k, k_rows, kinds.d), _packed(v, k_rows, kinds.d),
                          _packed(out.to(q.dtype), q_rows, kinds.d), lse_p, kinds.seqs(kind, seqs, q.device))
        dq = dq.view(b, -1, *dq.shape[1:])[..., :d_qk]  # [b, T, h_q, d_qk]
        dk = dk.view(b, -1, *dk.shape[1:])[..., :d_qk]  # [b, T_k, h_kv, d_qk]
        dv = dv.view(b, -1, *dv.shape[1:])[..., :d_v]
        at_q = at_k = 0
        for s in seqs:
            n, m = s.q_hi - s.q_lo, s.k_hi - s.k_lo
            gq, gk, gv = dq[:, at_q:at_q + n], dk[:, at_k:at_k + m], dv[:, at_k:at_k + m]
            at_q, at_k = at_q + n, at_k + m
            if s.block in kinds.whole:
                grads[s.block] = (gq, gk, gv)
                continue
            rows, keys = slice(s.piece.q_lo, s.piece.q_hi), slice(s.piece.k_lo, s.piece.k_hi)
            g = grads[s.block]
            g[0][:, rows] += gq
            g[1][:, keys] += gk
            g[2][:, keys] += gv
    return [g if i in kinds.whole else (g[0].to(q.dtype), g[1].to(k.dtype), g[2].to(v.dtype))
            for i, g in enumerate(grads)]
