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
blocks (host integers of the cached schedule): nothing is read back from the device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import torch

from .base import BlockArgs, LiveBlock
from .driver import _pad_to, lse_dtype, padded_head_dim


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
    y = _pad_to(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1), d)
    return y.reshape(-1, *y.shape[2:])


@functools.lru_cache(maxsize=256)
def _cu_seqlens(lengths: tuple[int, ...], batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """int32 ``cu_seqlens`` of ``lengths`` repeated for each batch row (batch-major), and the longest.

    Cached: a step's lengths come from the cached schedule, so each layer and micro-batch reuses the
    tensor the first one moved to the device (host values in, no read back)."""
    cu, total = [0], 0
    for _ in range(batch):
        for n in lengths:
            total += n
            cu.append(total)
    return torch.tensor(cu, dtype=torch.int32).to(device), max(lengths)


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

    def cu(self, seqs: list[_Seq], device) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        cu_q, max_q = _cu_seqlens(tuple(s.q_hi - s.q_lo for s in seqs), self.batch, device)
        cu_k, max_k = _cu_seqlens(tuple(s.k_hi - s.k_lo for s in seqs), self.batch, device)
        return cu_q, cu_k, max_q, max_k


def varlen_forward(call, q, k, v, blocks: Sequence[Block], pieces_for: PiecesFn, head_multiple: int):
    """(out, lse) of every block through ``call(q, k, v, cu_q, cu_k, max_q, max_k, scale, kind)``, one call
    per kind: q ``[T, h_q, D]``, k/v ``[T_k, h_kv, D]`` → out ``[T, h_q, D]``, lse ``[h_q, T]``."""
    b, _, h_q, _ = q.shape
    d_v = v.shape[-1]
    kinds = _Kinds(blocks, pieces_for, q, v, head_multiple)
    results: list = [None] * len(blocks)
    for i, blk in enumerate(blocks):
        if i not in kinds.whole:
            n = blk.q_hi - blk.q_lo
            results[i] = (q.new_zeros(b, n, h_q, d_v),
                          torch.full((b, h_q, n), float("-inf"), dtype=lse_dtype(q), device=q.device))
    for kind, seqs in kinds.groups.items():
        scale = blocks[seqs[0].block].args.softmax_scale
        qp = _packed(q, [(s.q_lo, s.q_hi) for s in seqs], kinds.d)
        kp = _packed(k, [(s.k_lo, s.k_hi) for s in seqs], kinds.d)
        vp = _packed(v, [(s.k_lo, s.k_hi) for s in seqs], kinds.d)
        out, lse = call(qp, kp, vp, *kinds.cu(seqs, q.device), scale, kind)
        total = out.shape[0] // b
        out = out.view(b, total, h_q, kinds.d)[..., :d_v]  # [b, T, h_q, d_v]
        lse = lse.view(h_q, b, total).transpose(0, 1)  # [b, h_q, T]
        at = 0
        for s in seqs:
            n = s.q_hi - s.q_lo
            o, l = out[:, at:at + n], lse[:, :, at:at + n]
            at += n
            if s.block in kinds.whole:
                results[s.block] = (o, l.to(lse_dtype(q)))
                continue
            rows = slice(s.piece.q_lo, s.piece.q_hi)
            results[s.block][0][:, rows] = o
            results[s.block][1][:, :, rows] = l
    return results


def varlen_backward(call, dout, q, k, v, out, lse, blocks: Sequence[Block], pieces_for: PiecesFn,
                    head_multiple: int):
    """(dq, dk, dv) of every block through ``call(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale,
    kind)`` (packed like :func:`varlen_forward`; lse ``[h_q, T]``), one call per kind."""
    b, _, h_q, d_qk = q.shape
    d_v = v.shape[-1]
    kinds = _Kinds(blocks, pieces_for, q, v, head_multiple)
    acc = torch.promote_types(q.dtype, torch.float32)  # pieces of one block share keys
    grads: list = [None] * len(blocks)
    for i, blk in enumerate(blocks):
        if i not in kinds.whole:
            rows, keys = blk.q_hi - blk.q_lo, blk.k_hi - blk.k_lo
            grads[i] = (torch.zeros(b, rows, h_q, d_qk, dtype=acc, device=q.device),
                        torch.zeros(b, keys, *k.shape[2:], dtype=acc, device=q.device),
                        torch.zeros(b, keys, *v.shape[2:], dtype=acc, device=q.device))
    lse = lse.to(lse_dtype(q))
    for kind, seqs in kinds.groups.items():
        scale = blocks[seqs[0].block].args.softmax_scale
        q_rows, k_rows = [(s.q_lo, s.q_hi) for s in seqs], [(s.k_lo, s.k_hi) for s in seqs]
        lse_p = torch.cat([lse[:, :, lo:hi] for lo, hi in q_rows], dim=-1)  # [b, h_q, T]
        lse_p = lse_p.transpose(0, 1).reshape(h_q, -1).contiguous()  # [h_q, b*T]
        dq, dk, dv = call(_packed(dout.to(q.dtype), q_rows, kinds.d), _packed(q, q_rows, kinds.d),
                          _packed(k, k_rows, kinds.d), _packed(v, k_rows, kinds.d),
                          _packed(out.to(q.dtype), q_rows, kinds.d), lse_p, *kinds.cu(seqs, q.device), scale, kind)
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
