"""The contract every block-attention kernel meets.

A *block* is one contiguous run of queries attending to one contiguous run of keys/values.  The
context-parallel algorithms in :mod:`megatron_longctx.attention` cut the global sequence into such
blocks, call a kernel per visible block and fold the partial results with
:func:`megatron_longctx.kernels.merge.merge` (the online softmax of FlashAttention, Dao et al. 2022).

Layouts (flash-attn's convention):
    q    ``[b, s_q, h_q, d_qk]``
    k    ``[b, s_k, h_kv, d_qk]``      ``h_q % h_kv == 0`` (GQA/MQA: K/V heads are *not* expanded)
    v    ``[b, s_k, h_kv, d_v]``       ``d_v`` may differ from ``d_qk`` (MLA)
    out  ``[b, s_q, h_q, d_v]``        dtype of ``q``
    lse  ``[b, h_q, s_q]``             float32, natural log of the softmax denominator

``lse`` is float64 for float64 inputs.  Gradients come back in the dtypes of ``q``, ``k``, ``v``.

Positions: query ``i`` of the block sits at global position ``q_start + i``, key ``j`` at
``k_start + j``; the mask is a function of those positions only (see :class:`BlockMask`).  A query
row that sees no key returns ``out = 0`` and ``lse = -inf`` and contributes no gradient.

``backward`` receives the *final* ``out``/``lse`` of each query row (after every block of the row has
been merged), as FlashAttention-2's backward does (Dao 2023, Algorithm 2); this is what lets ring
attention run the backward block by block.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

import torch


class KernelUnsupported(RuntimeError):
    """A backend cannot serve this case; the message says which property it cannot serve."""


class Visibility(enum.Enum):
    NONE = 0  # no (query, key) pair of the block is visible: skip it
    FULL = 1  # every pair is visible: no mask needed
    PARTIAL = 2  # some pairs are visible: the kernel must apply the mask



def accumulator_dtype(t: torch.Tensor) -> torch.dtype:
    """The contract's dtype for lse and every sum over blocks (the online softmax, dK/dV over calls) for
    inputs of ``t``'s dtype: float64 for float64, float32 otherwise."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32

@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Which key positions a query position sees.

    ``causal``: key position ``<=`` query position.  ``window = (left, right)`` as in flash-attn:
    a query at ``p`` sees keys in ``[p - left, p + right]``; ``-1`` leaves that side unbounded.
    Under ``causal`` the right side is ``0`` whatever ``window[1]`` says.
    """

    causal: bool = True
    window: tuple[int, int] = (-1, -1)

    def __post_init__(self) -> None:
        left, right = self.window
        if left < -1 or right < -1:
            raise ValueError(f"window_size={self.window}: each side must be >= 0, or -1 for unbounded")

    @property
    def left(self) -> int:
        return self.window[0]

    @property
    def right(self) -> int:
        """Effective right bound: 0 under causal, else ``window[1]`` (-1 = unbounded)."""
        return 0 if self.causal else self.window[1]

    @property
    def is_dense(self) -> bool:
        """True when every query sees every key (no causal, no window)."""
        return self.left < 0 and self.right < 0

    def visibility(self, q_start: int, q_len: int, k_start: int, k_len: int) -> Visibility:
        """Classify the block ``[q_start, q_start+q_len) x [k_start, k_start+k_len)``."""
        if q_len <= 0 or k_len <= 0:
            return Visibility.NONE
        q_last, k_last = q_start + q_len - 1, k_start + k_len - 1
        # Smallest and largest (query - key) distance inside the block.
        d_min, d_max = q_start - k_last, q_last - k_start
        if self.right >= 0 and d_max < -self.right:
            return Visibility.NONE
        if self.left >= 0 and d_min > self.left:
            return Visibility.NONE
        full = (self.right < 0 or d_min >= -self.right) and (self.left < 0 or d_max <= self.left)
        return Visibility.FULL if full else Visibility.PARTIAL

    def live_block(self, q_start: int, q_len: int, k_start: int, k_len: int) -> LiveBlock | None:
        """The smallest sub-block holding every visible pair of the block, or ``None`` if there is none.

        Row ``i`` of the block sees key ``j`` iff ``lo <= j - i <= hi`` with ``lo = d - left`` and
        ``hi = d + right`` (``d = q_start - k_start``; an unbounded side is ``None``).  The rows that
        see at least one key and the keys seen by at least one row are contiguous ranges, because
        the band slides by one key per row.
        """
        if q_len <= 0 or k_len <= 0:
            return None
        d = q_start - k_start
        lo = d - self.left if self.left >= 0 else None
        hi = d + self.right if self.right >= 0 else None
        # Row i sees something iff its band [i + lo, i + hi] meets [0, k_len).
        q_lo = 0 if hi is None else max(0, -hi)
        q_hi = q_len if lo is None else min(q_len, k_len - lo)
        if q_lo >= q_hi:
            return None
        k_lo = 0 if lo is None else max(0, q_lo + lo)
        k_hi = k_len if hi is None else min(k_len, q_hi + hi)
        # Re-express the band in the coordinates of the sub-block; drop sides that cut nothing there.
        shift = k_lo - q_lo
        s_q, s_k = q_hi - q_lo, k_hi - k_lo
        band_lo = None if lo is None or lo - shift <= -(s_q - 1) else lo - shift
        band_hi = None if hi is None or hi - shift >= s_k - 1 else hi - shift
        return LiveBlock(self, q_start, k_start, q_lo, q_hi, k_lo, k_hi, band_lo, band_hi)

    def dense(self, q_start: int, q_len: int, k_start: int, k_len: int, device=None) -> torch.Tensor:
        """Boolean ``[q_len, k_len]`` mask, True where the query sees the key."""
        q_pos = torch.arange(q_start, q_start + q_len, device=device)[:, None]
        k_pos = torch.arange(k_start, k_start + k_len, device=device)[None, :]
        dist = q_pos - k_pos  # [q_len, k_len]
        visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
        if self.right >= 0:
            visible &= dist >= -self.right
        if self.left >= 0:
            visible &= dist <= self.left
        return visible


@dataclasses.dataclass(frozen=True)
class LiveBlock:
    """The part of a block that holds every visible pair (see :meth:`BlockMask.live_block`).

    Rows ``[q_lo, q_hi)`` and keys ``[k_lo, k_hi)`` are indices into the original block.  Every row
    of the sub-block sees at least one key and every key is seen by at least one row.  Inside the
    sub-block, row ``i`` sees key ``j`` iff ``band_lo <= j - i <= band_hi``; ``None`` means the side
    cuts nothing.
    """

    mask: BlockMask
    q_start: int  # global position of row 0 of the *original* block
    k_start: int  # global position of key 0 of the *original* block
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    band_lo: int | None
    band_hi: int | None

    @property
    def s_q(self) -> int:
        return self.q_hi - self.q_lo

    @property
    def s_k(self) -> int:
        return self.k_hi - self.k_lo

    @property
    def is_full(self) -> bool:
        """Every row of the sub-block sees every key of it: no mask is needed."""
        return self.band_lo is None and self.band_hi is None

    def rows(self, start: int, stop: int) -> LiveBlock | None:
        """The live block of rows ``[start, stop)`` of the original block (same keys)."""
        # Keys at and beyond k_hi are seen by no row of the block, so [0, k_hi) covers the rows' keys.
        live = self.mask.live_block(self.q_start + start, stop - start, self.k_start, self.k_hi)
        if live is None:
            return None
        return dataclasses.replace(live, q_start=self.q_start, q_lo=live.q_lo + start, q_hi=live.q_hi + start)

    def flash_window(self) -> tuple[bool, int, int]:
        """``(causal, left, right)`` for kernels whose windows are bottom-right aligned (flash-attn >= 2.1).

        There row ``i`` sees key ``j`` iff ``i + s_k - s_q - left <= j <= i + s_k - s_q + right``; both
        values are ``>= 0`` (or ``-1``, unbounded) because the first and last rows of a live block see
        a key.  Causal is reported as ``(True, -1, -1)``.
        """
        shift = self.s_k - self.s_q
        right = -1 if self.band_hi is None else self.band_hi - shift
        left = -1 if self.band_lo is None else shift - self.band_lo
        if left == -1 and right == 0:
            return True, -1, -1
        return False, left, right

    def dense(self, device=None) -> torch.Tensor:
        """Boolean ``[s_q, s_k]`` mask of the sub-block, True where the row sees the key."""
        return self.mask.dense(self.q_start + self.q_lo, self.s_q, self.k_start + self.k_lo, self.s_k, device)


@dataclasses.dataclass(frozen=True)
class BlockArgs:
    """Non-tensor arguments of one block call."""

    softmax_scale: float
    mask: BlockMask = BlockMask()
    q_start: int = 0
    k_start: int = 0


class BlockKernel(Protocol):
    """One backend.  ``check`` returns ``None`` when the backend serves the case, else the reason."""

    name: str

    def check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: BlockArgs) -> str | None: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: BlockArgs
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        args: BlockArgs,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Validate the block layout shared by every backend (raises ``ValueError``)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [b, s, h, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, _, hq, dqk = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on [b, s_k, h_kv]")
    if k.shape[3] != dqk:
        raise ValueError(f"q and k head dims differ: {dqk} vs {k.shape[3]}")
    if hq % k.shape[2] != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({k.shape[2]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
