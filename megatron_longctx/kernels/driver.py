"""The shared driver of the fast block backends: trim, pad, run pieces, reassemble.

Fast attention kernels speak a narrower mask language than :class:`~.base.BlockMask`: a CPU flash
kernel knows "no mask", top-left causal and an explicit mask; flash-attn knows bottom-right aligned
windows.  None of them handles a row that sees no key the way the contract wants (``out = 0``,
``lse = -inf``), and most need equal (or 8-aligned) head dims for q, k and v.

The driver therefore hands a backend only *pieces*: :class:`~.base.LiveBlock` sub-blocks in which
every row sees at least one key, with the mask written as a band of diagonals.  Rows outside every
piece are filled with ``out = 0``/``lse = -inf`` here, keys outside every piece get zero gradients,
head dims are zero-padded (zeros add nothing to ``q·k`` and give zero output columns, so the padding
is exact), and dtypes are brought to what the kernels expect.  A backend supplies a
:class:`PieceKernel`: forward/backward of one piece.

Backward follows FlashAttention-2 (Dao 2023, Algorithm 2): given the final ``out``/``lse`` of each row,
the gradient of one block needs nothing from the others, so pieces are independent.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .base import BlockArgs, KernelUnsupported, LiveBlock, accumulator_dtype, check_shapes


def require(reason: str | None) -> None:
    """Raise :class:`KernelUnsupported` with a backend's ``check`` reason, if it gave one."""
    if reason is not None:
        raise KernelUnsupported(reason)


class PieceKernel(Protocol):
    """Forward/backward of one piece on tensors already sliced to it and padded to one head dim ``D``.

    ``forward(q, k, v, scale, piece)``: q ``[b, s_q, h_q, D]``, k/v ``[b, s_k, h_kv, D]`` →
    out ``[b, s_q, h_q, D]`` (q's dtype), lse ``[b, h_q, s_q]`` (float32; float64 for float64).
    ``backward(dout, q, k, v, out, lse, scale, piece)`` → dq, dk, dv shaped like q, k, v; ``dout`` and
    ``out`` come in q's dtype, ``lse`` contiguous and finite (the piece's rows are the final lse of
    rows that see a key of the piece).
    """

    head_multiple: int  # the padded head dim D is a multiple of this

    def forward(self, q, k, v, scale: float, piece: LiveBlock) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout, q, k, v, out, lse, scale: float, piece: LiveBlock): ...


def padded_head_dim(d_qk: int, d_v: int, multiple: int) -> int:
    return -(-max(d_qk, d_v) // multiple) * multiple


def flash_limits(name: str, unavailable: str | None, q: torch.Tensor, v: torch.Tensor, head_multiple: int,
                 max_head_dim: int) -> str | None:
    """What a half-precision flash backend refuses first (``None``: nothing): its device (``unavailable``: its
    ``available()``), a dtype other than float16/bfloat16, head dims that pad past ``max_head_dim``."""
    if unavailable is not None:
        return unavailable
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{name} supports float16 and bfloat16, not {q.dtype}"
    d = padded_head_dim(q.shape[-1], v.shape[-1], head_multiple)
    if d > max_head_dim:
        return f"{name} supports head dims up to {max_head_dim}; this block needs {d}"
    return None


def pad_head_dim(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x`` ``[..., d_x]`` -> ``[..., d]`` with zero columns (exact: see the module doc); no copy when d wide."""
    return x if x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))


def empty_result(q: torch.Tensor, rows: int, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a block of ``rows`` query rows returns before any piece: out ``[b, rows, h_q, d_v]`` = 0 (q's
    dtype), lse ``[b, h_q, rows]`` = -inf (the contract's lse dtype)."""
    b, h_q = q.shape[0], q.shape[2]
    return (q.new_zeros(b, rows, h_q, d_v),
            torch.full((b, h_q, rows), float("-inf"), dtype=accumulator_dtype(q), device=q.device))


def zero_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int, keys: int) -> tuple[torch.Tensor, ...]:
    """Zero dq ``[b, rows, h_q, d_qk]``, dk/dv ``[b, keys, h_kv, d]`` to sum pieces into: pieces share keys (never
    rows), so in at least float32."""
    acc = torch.promote_types(q.dtype, torch.float32)
    return tuple(torch.zeros(t.shape[0], n, *t.shape[2:], dtype=acc, device=t.device)
                 for t, n in ((q, rows), (k, keys), (v, keys)))


# Rows per tile of a block cut by both edges of a band (a sliding window's diagonal block).  Each tile
# is narrower than the band, so a kernel without window arguments serves it with three unmasked or
# causal calls (see cpu_flash); 1024 rows keep the calls few while a tile's keys stay within rows + w.
BAND_TILE_ROWS = 1024
# Bands narrower than this are served as masked tiles of this many rows: per-row calls would cost
# more in launches than the (rows x (rows + w)) masks cost in work.
MASKED_TILE_ROWS = 128


def band_tile_rows(live: LiveBlock) -> int | None:
    """Rows per tile for a live block cut by both band edges, or ``None`` when it needs no tiling.

    Tiles of fewer rows than the band is wide see every key between the two edges, which is what
    lets a kernel without window arguments split a tile into a left edge, an unmasked middle and
    a causal right edge.  A narrow band is tiled by :data:`MASKED_TILE_ROWS` (each tile masked).
    """
    if live.band_lo is None or live.band_hi is None:
        return None
    width = live.band_hi - live.band_lo + 1  # keys each row sees inside the band
    rows = min(BAND_TILE_ROWS, width - 1) if width - 1 >= MASKED_TILE_ROWS else MASKED_TILE_ROWS
    return rows if live.s_q > rows else None


def band_tiles(live: LiveBlock) -> list[LiveBlock]:
    """``live`` as row tiles of :func:`band_tile_rows` rows, each trimmed to the keys its rows see.

    A band of ``w`` keys per row over ``s`` rows becomes tiles of at most ``rows x (rows + w)``
    pairs: time and memory ``O(s * (rows + w))`` instead of the ``O(s^2)`` of the whole block.
    """
    rows = band_tile_rows(live)
    if rows is None:
        return [live]
    tiles = (live.rows(lo, min(lo + rows, live.q_hi)) for lo in range(live.q_lo, live.q_hi, rows))
    return [t for t in tiles if t is not None]


def pieces_for(args: BlockArgs, s_q: int, s_k: int) -> list[LiveBlock]:
    """The live block of the block as pieces (row tiles where a band cuts it on both sides)."""
    live = args.mask.live_block(args.q_start, s_q, args.k_start, s_k)
    return [] if live is None else band_tiles(live)


def flash2_pieces(args: BlockArgs, s_q: int, s_k: int) -> list[LiveBlock]:
    """Pieces on which flash-attn 2's window arguments mean exactly the band.

    flash-attn 2 (and torch's copy of it) rewrites ``window_size_right >= seqlen_k`` to unbounded and
    an unbounded right side next to a bounded left side to ``seqlen_k``.  Both rewrites are exact
    only when ``s_q <= s_k + 1``.  A masked live block with more rows splits at the rows where its
    right edge stops cutting (``s_k - 1 - band_hi``) and where its left edge starts cutting
    (``1 - band_lo``); each piece then has fewer rows than keys or needs no mask at all.
    """
    pieces = []
    for live in pieces_for(args, s_q, s_k):
        if live.is_full or live.s_q <= live.s_k + 1:
            pieces.append(live)
            continue
        cuts = {live.q_lo, live.q_hi}
        if live.band_hi is not None:
            cuts.add(live.q_lo + live.s_k - 1 - live.band_hi)
        if live.band_lo is not None:
            cuts.add(live.q_lo + 1 - live.band_lo)
        bounds = sorted(c for c in cuts if live.q_lo <= c <= live.q_hi)
        for start, stop in zip(bounds, bounds[1:]):
            part = live.rows(start, stop)
            if part is None:
                continue
            if not (part.is_full or part.s_q <= part.s_k + 1):
                raise AssertionError(f"row split left an unsafe flash-attn 2 piece: {part}")
            pieces.append(part)
    return pieces


def forward(
    kernel: PieceKernel, pieces: list[LiveBlock], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: BlockArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block forward through ``kernel``: out ``[b, s_q, h_q, d_v]`` (q's dtype), lse ``[b, h_q, s_q]``."""
    check_shapes(q, k, v)
    b, s_q, h_q, d_qk = q.shape
    d_v = v.shape[-1]
    d = padded_head_dim(d_qk, d_v, kernel.head_multiple)
    whole = len(pieces) == 1 and pieces[0].q_lo == 0 and pieces[0].q_hi == s_q
    if not whole:
        out, lse = empty_result(q, s_q, d_v)
    for p in pieces:
        qp = pad_head_dim(q[:, p.q_lo : p.q_hi], d)  # [b, s_q', h_q, D]
        kp = pad_head_dim(k[:, p.k_lo : p.k_hi], d)  # [b, s_k', h_kv, D]
        vp = pad_head_dim(v[:, p.k_lo : p.k_hi], d)  # [b, s_k', h_kv, D]
        o, l = kernel.forward(qp, kp, vp, args.softmax_scale, p)
        o = o[..., :d_v]  # [b, s_q', h_q, d_v]
        if whole:
            return o.contiguous(), l.to(accumulator_dtype(q)).contiguous()
        out[:, p.q_lo : p.q_hi] = o
        lse[:, :, p.q_lo : p.q_hi] = l
    return out, lse


def backward(
    kernel: PieceKernel,
    pieces: list[LiveBlock],
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    args: BlockArgs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block backward through ``kernel`` given the final ``out``/``lse`` of each row; grads like q, k, v."""
    check_shapes(q, k, v)
    s_q, s_k = q.shape[1], k.shape[1]
    d_qk, d_v = q.shape[-1], v.shape[-1]
    d = padded_head_dim(d_qk, d_v, kernel.head_multiple)
    single = len(pieces) == 1 and (pieces[0].s_q, pieces[0].s_k) == (s_q, s_k)
    if not single:
        dq, dk, dv = zero_grads(q, k, v, s_q, s_k)
    # Every row of a piece sees a key of it, so its final lse is finite: no row needs the +inf of a
    # row that saw nothing anywhere, and lse goes to the kernel as it is (no full-size masked copy).
    lse = lse.to(accumulator_dtype(q))  # [b, h_q, s_q]
    for p in pieces:
        rows, keys = slice(p.q_lo, p.q_hi), slice(p.k_lo, p.k_hi)
        dop = pad_head_dim(dout[:, rows].to(q.dtype), d)  # [b, s_q', h_q, D]
        op = pad_head_dim(out[:, rows].to(q.dtype), d)  # [b, s_q', h_q, D]
        gq, gk, gv = kernel.backward(
            dop,
            pad_head_dim(q[:, rows], d),
            pad_head_dim(k[:, keys], d),
            pad_head_dim(v[:, keys], d),
            op,
            lse[:, :, rows].contiguous(),
            args.softmax_scale,
            p,
        )
        gq, gk, gv = gq[..., :d_qk], gk[..., :d_qk], gv[..., :d_v]
        if single:
            return gq.contiguous(), gk.contiguous(), gv.contiguous()
        dq[:, rows] += gq
        dk[:, keys] += gk
        dv[:, keys] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
