"""Block attention on CPU through PyTorch's flash-attention kernel for CPU.

Uses ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward, the ops that return the
logsumexp alongside the output (FlashAttention's tiling, Dao et al. 2022, in PyTorch's CPU kernels); what
the ops do and refuse is listed at :func:`_op_forward`.  They know no mask but their top-left causal one, so
:class:`_CpuPieces` splits each piece's keys where the band's edges stop cutting (:func:`_parts`) and merges
the calls.  The driver never hands the op a row that sees no key: the op gets such rows wrong.
Backends, pieces and live blocks: docs/attention.md and docs/glossary.md.
"""

from __future__ import annotations

import enum
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
    """The op on ``[b, s, h, d]`` tensors.  What the op does, read off torch 2.13 and 2.14:

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
    """
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


class _Part(enum.Enum):
    """How one range of a piece's keys goes to the op."""

    FULL = "full"  # every row sees every key: no mask
    CAUSAL = "causal"  # row i sees key j iff j <= i: the op's top-left causal
    FLIPPED = "flipped"  # row i sees key j iff j >= i + (s_k - s_q): causal on reversed rows and keys
    MASKED = "masked"  # anything else: an additive mask


def _parts(piece: LiveBlock) -> list[tuple[int, int, _Part]]:
    """The piece's keys as ranges ``(lo, hi, part)``; together they score each visible pair once.

    In piece coordinates row ``i`` sees key ``j`` iff ``band_lo <= j - i <= band_hi``.  Keys below
    ``t0 = s_q + band_lo`` are cut only by the left edge (reversed, that is top-left causal), keys
    from ``band_hi`` on only by the right edge (top-left causal from there), keys in between by
    neither.  That holds when ``t0 <= band_hi``, i.e. the piece has fewer rows than the band is wide,
    which :func:`.driver.band_tiles` arranges; a narrower band is masked.
    """
    lo, hi, s_q, s_k = piece.band_lo, piece.band_hi, piece.s_q, piece.s_k
    if lo is None and hi is None:
        return [(0, s_k, _Part.FULL)]
    t0 = 0 if lo is None else s_q + lo  # 2 <= t0 <= s_k: the first and last rows see a key
    t1 = s_k if hi is None else hi  # 0 <= t1 <= s_k - 2 when the right edge cuts
    if t0 > t1:
        return [(0, s_k, _Part.MASKED)]
    parts = [(0, t0, _Part.FLIPPED), (t0, t1, _Part.FULL), (t1, s_k, _Part.CAUSAL)]
    return [p for p in parts if p[1] > p[0]]


def _flip(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.flip(1) for x in xs]  # [b, s, h, d]: reverse the sequence


class _CpuPieces:
    """:class:`.driver.PieceKernel` over the CPU op.

    Masks per piece (a :class:`~.base.LiveBlock`): the op knows no mask and top-left causal only, so a
    piece's keys are split where the band's edges stop cutting (:func:`_parts`): keys cut by the right
    edge only are top-left causal, keys cut by neither need no mask, keys cut by the left edge only are
    top-left causal on reversed rows and keys.  Each range is one call; the calls are merged with
    :func:`.merge.merge` (backward: ``dq`` summed, ``dk``/``dv`` concatenated).  A sliding window's
    diagonal block reaches this kernel as row tiles narrower than the band (:func:`.driver.band_tiles`),
    so no call is masked and the work is linear in the sequence.  Only bands of at most
    :data:`.driver.MASKED_TILE_ROWS` keys use an additive mask, per tile of that many rows.
    """

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

    def _part_forward(self, q, k, v, scale: float, part: _Part, piece: LiveBlock):
        if part is _Part.FLIPPED:
            out, lse = _op_forward(*_flip(q, k, v), scale, True)
            return out.flip(1), lse.flip(-1)
        mask = self._additive_mask(piece, q) if part is _Part.MASKED else None
        return _op_forward(q, k, v, scale, part is _Part.CAUSAL, mask)

    def _part_backward(self, dout, q, k, v, out, lse, scale: float, part: _Part, piece: LiveBlock):
        if part is _Part.FLIPPED:
            grads = _op_backward(*_flip(dout, q, k, v, out), lse.flip(-1).contiguous(), scale, True)
            return [g.flip(1) for g in grads]
        mask = self._additive_mask(piece, q) if part is _Part.MASKED else None
        return _op_backward(dout, q, k, v, out, lse, scale, part is _Part.CAUSAL, mask)

    def forward(self, q, k, v, scale: float, piece: LiveBlock):
        k, v = self._expand(q, k, v)
        out = lse = None
        for lo, hi, part in _parts(piece):
            o, l = self._part_forward(q, k[:, lo:hi], v[:, lo:hi], scale, part, piece)
            out, lse = (o, l) if out is None else merge(out, lse, o, l)
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, scale: float, piece: LiveBlock):
        h_kv = k.shape[2]
        k, v = self._expand(q, k, v)
        parts = _parts(piece)
        acc = torch.promote_types(q.dtype, torch.float32)
        dq, dks, dvs = None, [], []
        for lo, hi, part in parts:
            gq, gk, gv = self._part_backward(dout, q, k[:, lo:hi], v[:, lo:hi], out, lse, scale, part, piece)
            dq = gq if len(parts) == 1 else gq.to(acc) if dq is None else dq + gq.to(acc)
            dks.append(gk)
            dvs.append(gv)
        dk, dv = (xs[0] if len(xs) == 1 else torch.cat(xs, dim=1) for xs in (dks, dvs))  # [b, s_k, h, d]
        dk, dv = self._fold(dk, dv, h_kv)
        return dq.to(q.dtype), dk, dv


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
