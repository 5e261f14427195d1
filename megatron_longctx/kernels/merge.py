"""Exact combination of partial attention results (the online softmax).

Two partial results over disjoint key sets, ``(out_a, lse_a)`` and ``(out_b, lse_b)``, combine into
the result over the union: ``lse = log(exp(lse_a) + exp(lse_b))`` and
``out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b`` (Milakov & Gimelshein 2018; FlashAttention).
"""

from __future__ import annotations

import torch


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partials.

    ``out_*``: ``[b, s, h, d]``; ``lse_*``: ``[b, h, s]``.  Returns ``out`` in float32 (float64 when
    an input is float64) and ``lse`` in the wider of the two lse dtypes.  Rows where both sides saw
    nothing (``lse = -inf``) stay ``out = 0``, ``lse = -inf``.
    """
    acc = torch.float64 if torch.float64 in (out_a.dtype, out_b.dtype, lse_a.dtype, lse_b.dtype) else torch.float32
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    lse = torch.logaddexp(lse_a, lse_b)  # [b, h, s]
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w_a = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(lse))  # [b, h, s]
    w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse))
    # [b, h, s] -> [b, s, h, 1] to scale out
    out = w_a.transpose(1, 2).unsqueeze(-1) * out_a.to(acc) + w_b.transpose(1, 2).unsqueeze(-1) * out_b.to(acc)
    return out, lse


def merge_(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold the partial ``(out, lse)`` into the accumulator ``(out_acc, lse_acc)`` in place (views allowed).

    ``out_acc`` ``[b, s, h, d]`` and ``lse_acc`` ``[b, h, s]`` in the accumulator dtype (float32, or
    float64); ``out`` may be narrower.  Same result as :func:`merge`, without its temporaries: the
    weights are taken against ``lse`` floored at the dtype's lowest value, so a row where both sides
    saw nothing gets weights ``exp(-inf) = 0`` instead of NaN and stays ``out = 0``, ``lse = -inf``.
    """
    new = torch.logaddexp(lse_acc, lse)  # [b, h, s]
    floor = new.clamp(min=torch.finfo(new.dtype).min)
    w_acc = torch.exp(lse_acc - floor).transpose(1, 2).unsqueeze(-1)  # [b, h, s] -> [b, s, h, 1]
    w = torch.exp(lse - floor).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(w_acc).addcmul_(out, w)
    lse_acc.copy_(new)

