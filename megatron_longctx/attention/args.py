"""The non-tensor arguments of context-parallel attention and their validation (a leaf module).

Every unsupported case is a ``ValueError`` naming the parameter and the fix.  The entry points
(:mod:`.api`) call these checks before any transfer; the algorithm modules receive the checked
:class:`AttentionArgs`.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch

from ..kernels.base import BlockMask
from .. import cp_algorithms as algorithms

ALGORITHMS = algorithms.NAMES


@dataclasses.dataclass(frozen=True)
class AttentionArgs:
    """Non-tensor arguments shared by every pattern."""

    softmax_scale: float  # multiplies q·k before the softmax
    mask: BlockMask  # causal flag and sliding window, as a function of (document-relative) positions
    backend: str | None  # block kernel name for kernels.select.kernel_for; None = automatic


def attention_args(q: torch.Tensor, causal: bool, softmax_scale: float | None, window_size,
                   backend: str | None) -> AttentionArgs:
    """Checked :class:`AttentionArgs`; ``softmax_scale`` defaults to ``1/sqrt(d_qk)``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return AttentionArgs(softmax_scale=scale, mask=BlockMask(causal=bool(causal), window=check_window(window_size)),
                         backend=backend)


# token dims -> (layout, what q, k and v must share)
_LAYOUTS = {2: ("[s, b, h, d]", "agree on [s, b]"), 1: ("[t, h, d] (THD)", "hold the same tokens")}


def check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_dims: int = 2) -> None:
    """q, k, v agree as self-attention inputs: ``token_dims`` leading token dims ([s, b] or packed [t]),
    then heads and head dim."""
    (layout, same_tokens), ndim = _LAYOUTS[token_dims], token_dims + 2
    if q.dim() != ndim or k.dim() != ndim or v.dim() != ndim:
        raise ValueError(f"q, k, v must be {layout}; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if not (q.shape[:token_dims] == k.shape[:token_dims] == v.shape[:token_dims]):
        raise ValueError(f"q, k, v must {same_tokens} (self-attention); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv != v.shape[-2]:
        raise ValueError(f"k and v must have the same number of heads; got k {hkv}, v {v.shape[-2]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share the head dim d_qk; got q {q.shape[-1]}, k {k.shape[-1]}")
    if hq % hkv != 0:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hkv}) (GQA/MQA)")
    if token_dims == 2 and (q.shape[0] == 0 or q.shape[1] == 0):
        raise ValueError(f"q has an empty sequence or batch: {tuple(q.shape)}")


def check_window(window_size) -> tuple[int, int]:
    if window_size is None:
        return (-1, -1)
    try:
        left, right = (operator.index(w) for w in window_size)
    except (TypeError, ValueError):
        left = right = -2
    if left < -1 or right < -1:
        raise ValueError(f"window_size={window_size!r} must be (left, right) with ints >= 0, or -1 for unbounded")
    return left, right


def check_local_length(s_local: int, cp_size: int) -> None:
    if s_local % 2 != 0:
        raise ValueError(
            f"q.shape[0]={s_local}: each rank holds 2 of the 2*cp={2 * cp_size} chunks, so the global "
            f"sequence length (s_global = cp*{s_local} = {cp_size * s_local}) must be divisible by "
            f"2*cp={2 * cp_size}; pad the sequence (Megatron: --seq-length)"
        )


def kv_replication(hq: int, hkv: int, size: int) -> int:
    """Smallest ``f`` dividing ``hq/hkv`` with ``hkv*f`` divisible by ``size`` (needs ``hq % size == 0``).

    Ulysses with fewer K/V heads than ranks replicates each K/V head ``f`` times so that every rank
    receives whole query groups with their K/V head.
    """
    if hq % size != 0:
        raise ValueError(
            f"Ulysses needs the query heads ({hq}) divisible by the all-to-all group size ({size}); "
            f"use algorithm='ring', or algorithm='hybrid' with a ulysses_size that divides {hq}"
        )
    group = hq // hkv
    return next(f for f in range(1, group + 1) if group % f == 0 and (hkv * f) % size == 0)


def check_ulysses_size(algorithm: str, cp_size: int, hq: int, ulysses_size, hcp_groups) -> None:
    """The all-to-all group size parameters of ``algorithm`` (the groups themselves: :mod:`.hybrid`)."""
    heads = algorithms.get(algorithm).heads
    if heads == "none" and (ulysses_size is not None or hcp_groups is not None):
        raise ValueError(f"ulysses_size / hcp_groups apply to algorithm='hybrid' (or 'ulysses'), "
                         f"not {algorithm!r}")
    if heads == "all":
        if hcp_groups is not None or ulysses_size not in (None, cp_size):
            raise ValueError(f"algorithm={algorithm!r} spans the whole cp_group (size {cp_size}); got ulysses_size="
                             f"{ulysses_size}, hcp_groups={hcp_groups}: use algorithm='hybrid' for a smaller "
                             "a2a group")
        if cp_size > 1 and hq % cp_size != 0:
            kv_replication(hq, 1, cp_size)  # raises the ValueError for hq % cp != 0
    if heads != "groups" or cp_size == 1 or hcp_groups is not None:
        return
    if ulysses_size is None:
        raise ValueError(f"algorithm={algorithm!r} needs ulysses_size= (the all-to-all group size) or hcp_groups=")
    if not isinstance(ulysses_size, int) or ulysses_size < 1 or cp_size % ulysses_size != 0:
        raise ValueError(f"ulysses_size={ulysses_size} must be a positive divisor of the cp size {cp_size}")
    if hq % ulysses_size != 0:
        raise ValueError(f"ulysses_size={ulysses_size} must divide the query heads ({hq}); choose a divisor of "
                         f"both {hq} and {cp_size}, or use algorithm='ring'")
