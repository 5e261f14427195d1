"""Block attention on CPU through PyTorch's flash-attention kernel for CPU.

Uses ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, the ops that return the
logsumexp alongside the output (FlashAttention's tiling, Dao et al. 2022, in PyTorch's CPU kernels).
What the op does, read off torch 2.13 and 2.14:

- layout ``[b, h, s, d]`` with arbitrary strides, so ``[b, s, h, d]`` tensors go in as transposed
  views without copies; the output (and the gradients) come back with ``[b, s, h, d]`` memory;
- ``lse`` ``[b, h, s_q]`` in float32 (float64 for float64 inputs);
- float64, float32, bfloat16 and float16;
- ``is_causal`` is *top-left* aligned (query ``i`` sees keys ``j <= i``), also when ``s_q != s_k``;
- ``attn_mask`` must be floating (additive); a boolean mask is refused;
- q, k and v must share one head dim (zero padding in :mod:`.driver` serves ``d_qk != d_v``);
- k/v with fewer heads than q (GQA/MQA) are accepted (probed once, see :func:`native_gqa`);
- a row whose mask hides every key returns ``out = 0`` with ``lse = 0`` (not ``-inf``), an empty
  ``s_q`` or ``s_k`` kills the process (SIGFPE), and backward given ``lse = -inf`` returns NaN.
  The driver never hands the op such rows: every row of a piece sees a key, so its final lse is finite.

Masks per piece (a :class:`~.base.LiveBlock`): no band → no mask; band ``j - i <= 0`` → ``is_causal``;
band ``j - i <= t`` with ``t > 0`` → keys ``[0, t)`` are seen by every row (no mask) and the rest is
top-left causal, two calls merged with :func:`.merge.merge` (backward: ``dq`` summed, ``dk``/``dv``
concatenated); any other band (sliding windows) → an additive ``[s_q, s_k]`` mask from
:meth:`.base.BlockMask.dense` in q's dtype: ``O(s_q * s_k)`` memory (plus a boolean temporary of
the same count) per call, for the trimmed piece only.
"""

from __future__ import annotations

import functools

import torch

from . import driver
from .base import BlockArgs, LiveBlock
from .merge import merge

name = "cpu_flash"

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _op_forward(q, k, v, scale: float, causal: bool, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    # [b, s, h, d] -> [b, h, s, d] views in, out back to [b, s_q, h_q, d]; lse [b, h_q, s_q]
    out, lse = _FWD(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=mask, scale=scale)
    return out.transpose(1, 2), lse


def _op_backward(dout, q, k, v, out, lse, scale: float, causal: bool, mask=None):
    t = [x.transpose(1, 2) for x in (dout, q, k, v, out)]  # [b, s, h, d] -> [b, h, s, d] views
    dq, dk, dv = _BWD(*t, lse, 0.0, causal, attn_mask=mask, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)  # back to [b, s, h, d]


@functools.lru_cache(maxsize=None)
def native_gqa() -> bool:
    """Whether this torch's CPU op takes k/v with fewer heads than q and matches expanded heads."""
    gen = torch.Generator().manual_seed(0)
    q = torch.rand(1, 3, 4, 8, generator=gen)  # [b, s, h_q, d]
    k, v = torch.rand(2, 1, 5, 2, 8, generator=gen)  # [b, s_k, h_kv, d] each
    try:
        got, _ = _op_forward(q, k, v, 0.5, False)
    except RuntimeError:
        return False
    want, _ = _op_forward(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2), 0.5, False)
    return got.shape == want.shape and torch.allclose(got, want)


class _CpuPieces:
    """:class:`.driver.PieceKernel` over the CPU op (see the module docstring for the masks)."""

    head_multiple = 1

    @staticmethod
    def _expand(q, k, v):
        if k.shape[2] == q.shape[2] or native_gqa():
            return k, v
        g = q.shape[2] // k.shape[2]
        return k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)  # [b, s_k, h_q, d]

    @staticmethod
    def _fold(dk, dv, h_kv: int):
        if dk.shape[2] == h_kv:
            return dk, dv
        # [b, s_k, h_q, d] -> [b, s_k, h_kv, g, d] -> sum over the g query heads of each kv head
        return dk.unflatten(2, (h_kv, -1)).sum(3), dv.unflatten(2, (h_kv, -1)).sum(3)

    @staticmethod
    def _additive_mask(piece: LiveBlock, like: torch.Tensor) -> torch.Tensor:
        visible = piece.dense(like.device)  # [s_q, s_k] bool
        return torch.zeros(visible.shape, dtype=like.dtype, device=like.device).masked_fill_(~visible, float("-inf"))

    def forward(self, q, k, v, scale: float, piece: LiveBlock):
        k, v = self._expand(q, k, v)
        if piece.is_full:
            return _op_forward(q, k, v, scale, False)
        if piece.band_lo is None and piece.band_hi == 0:
            return _op_forward(q, k, v, scale, True)
        if piece.band_lo is None:
            t = piece.band_hi
            out_a, lse_a = _op_forward(q, k[:, :t], v[:, :t], scale, False)
            out_b, lse_b = _op_forward(q, k[:, t:], v[:, t:], scale, True)
            out, lse = merge(out_a, lse_a, out_b, lse_b)
            return out.to(q.dtype), lse
        return _op_forward(q, k, v, scale, False, self._additive_mask(piece, q))

    def backward(self, dout, q, k, v, out, lse, scale: float, piece: LiveBlock):
        h_kv = k.shape[2]
        k, v = self._expand(q, k, v)
        if piece.is_full:
            dq, dk, dv = _op_backward(dout, q, k, v, out, lse, scale, False)
        elif piece.band_lo is None and piece.band_hi == 0:
            dq, dk, dv = _op_backward(dout, q, k, v, out, lse, scale, True)
        elif piece.band_lo is None:
            t = piece.band_hi
            dq_a, dk_a, dv_a = _op_backward(dout, q, k[:, :t], v[:, :t], out, lse, scale, False)
            dq_b, dk_b, dv_b = _op_backward(dout, q, k[:, t:], v[:, t:], out, lse, scale, True)
            acc = torch.promote_types(q.dtype, torch.float32)
            dq = (dq_a.to(acc) + dq_b.to(acc)).to(q.dtype)
            dk, dv = torch.cat([dk_a, dk_b], dim=1), torch.cat([dv_a, dv_b], dim=1)  # [b, s_k, h, d]
        else:
            dq, dk, dv = _op_backward(dout, q, k, v, out, lse, scale, False, self._additive_mask(piece, q))
        dk, dv = self._fold(dk, dv, h_kv)
        return dq, dk, dv


_KERNEL = _CpuPieces()


def available(device: torch.device) -> str | None:
    """``None`` when the backend can run on ``device`` at all, else the reason."""
    return None if torch.device(device).type == "cpu" else f"cpu_flash runs on CPU tensors, not {device}"


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: BlockArgs) -> str | None:
    reason = available(q.device)
    if reason is None and q.dtype not in _DTYPES:
        reason = f"cpu_flash supports float64, float32, bfloat16 and float16, not {q.dtype}"
    return reason


@torch.no_grad()
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: BlockArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Block forward (layouts in :mod:`.base`): out ``[b, s_q, h_q, d_v]``, lse ``[b, h_q, s_q]``."""
    driver.require(check(q, k, v, args))
    return driver.forward(_KERNEL, driver.pieces_for(args, q.shape[1], k.shape[1]), q, k, v, args)


@torch.no_grad()
def backward(dout, q, k, v, out, lse, args: BlockArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block backward given the final ``out``/``lse`` of each row (FlashAttention-2 backward)."""
    driver.require(check(q, k, v, args))
    pieces = driver.pieces_for(args, q.shape[1], k.shape[1])
    return driver.backward(_KERNEL, pieces, dout, q, k, v, out, lse, args)
