"""Plain PyTorch attention on one block: the test oracle for every other backend.

Computes in float64 for float64 inputs and in float32 otherwise; returns ``out`` in the input dtype and
``lse`` in float32 (float64 for float64 inputs, so float64 tests stay exact).  Memory is
``O(s_q * s_k)`` per block, except under a sliding window: a windowed block is scored only on its live
block, as the row tiles of :func:`.driver.pieces_for` (``O(s * (tile + w))``).
"""

from __future__ import annotations

import torch

from . import driver
from .base import BlockArgs, LiveBlock, accumulator_dtype, check_shapes

name = "reference"


def _expand_kv(x: torch.Tensor, hq: int) -> torch.Tensor:
    # [b, s_k, h_kv, d] -> [b, s_k, h_q, d]
    return x.repeat_interleave(hq // x.shape[2], dim=2)


def _scores(q: torch.Tensor, k: torch.Tensor, args: BlockArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled, masked scores ``[b, h_q, s_q, s_k]`` and the visibility mask ``[s_q, s_k]``."""
    dt = accumulator_dtype(q)
    kx = _expand_kv(k, q.shape[2]).to(dt)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(dt), kx) * args.softmax_scale
    visible = args.mask.dense(args.q_start, q.shape[1], args.k_start, k.shape[1], device=q.device)
    return s.masked_fill(~visible, float("-inf")), visible


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(s - lse)`` ``[b, h, s_q, s_k]``; a row with ``lse = -inf`` saw nothing and gets zeros."""
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # exp(-inf - inf) = exp(x - inf) = 0
    return torch.exp(s - lse.unsqueeze(-1))


class _Pieces:
    """:class:`.driver.PieceKernel` that runs this module's dense math on one piece."""

    head_multiple = 1

    @staticmethod
    def _args(scale: float, piece: LiveBlock) -> BlockArgs:
        return BlockArgs(scale, piece.mask, piece.q_start + piece.q_lo, piece.k_start + piece.k_lo)

    def forward(self, q, k, v, scale: float, piece: LiveBlock):
        return _forward(q, k, v, self._args(scale, piece))

    def backward(self, dout, q, k, v, out, lse, scale: float, piece: LiveBlock):
        return _backward(dout, q, k, v, out, lse, self._args(scale, piece))


_PIECES = _Pieces()


def available(device: torch.device) -> str | None:
    """Runs on every device."""
    return None


def check(q, k, v, args: BlockArgs) -> str | None:
    """Serves every case."""
    return None


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: BlockArgs) -> tuple[torch.Tensor, torch.Tensor]:
    check_shapes(q, k, v)
    if args.mask.left >= 0:
        return driver.forward(_PIECES, driver.pieces_for(args, q.shape[1], k.shape[1]), q, k, v, args)
    return _forward(q, k, v, args)


def _forward(q, k, v, args: BlockArgs) -> tuple[torch.Tensor, torch.Tensor]:
    s, _ = _scores(q, k, args)  # [b, h, s_q, s_k]
    lse = torch.logsumexp(s, dim=-1)  # [b, h, s_q]; -inf for rows that see nothing
    p = _probs(s, lse)
    vx = _expand_kv(v, q.shape[2]).to(s.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vx)  # [b, s_q, h_q, d_v]
    return out.to(q.dtype), lse.to(accumulator_dtype(q))


def backward(dout, q, k, v, out, lse, args: BlockArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for one block given the *final* ``out``/``lse`` of the whole row (FlashAttention-2 bwd)."""
    check_shapes(q, k, v)
    if args.mask.left >= 0:
        pieces = driver.pieces_for(args, q.shape[1], k.shape[1])
        return driver.backward(_PIECES, pieces, dout, q, k, v, out, lse, args)
    return _backward(dout, q, k, v, out, lse, args)


def _backward(dout, q, k, v, out, lse, args: BlockArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hq, hkv = q.shape[2], k.shape[2]
    s, _ = _scores(q, k, args)  # [b, h, s_q, s_k]
    dt = s.dtype
    p = _probs(s, lse.to(dt))  # [b, h, s_q, s_k]
    do = dout.to(dt)
    vx = _expand_kv(v, hq).to(dt)
    dvx = torch.einsum("bhqk,bqhd->bkhd", p, do)  # [b, s_k, h_q, d_v]
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vx)
    delta = (do * out.to(dt)).sum(-1).transpose(1, 2)  # [b, h, s_q]
    ds = p * (dp - delta.unsqueeze(-1)) * args.softmax_scale
    kx = _expand_kv(k, hq).to(dt)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kx)
    dkx = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(dt))
    g = hq // hkv
    # Sum the gradients of the q heads that share one kv head: [b, s_k, h_kv, g, d] -> [b, s_k, h_kv, d]
    dk = dkx.unflatten(2, (hkv, g)).sum(3)
    dv = dvx.unflatten(2, (hkv, g)).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
