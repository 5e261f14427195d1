"""Attention sinks: one extra logit per head in every query row's softmax denominator.

Softmax off-by-one (Miller 2023, "Attention is off by one") and the learnable sinks of gpt-oss
(OpenAI 2025; Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks") add a
per-head logit ``σ_h`` to the softmax of every query row, with no value attached:
``p_j = exp(s_j) / (Σ_k exp(s_k) + exp(σ_h))``.  Megatron-Core (``--softmax-type off-by-one`` with
``σ = 0``, ``learnable`` with a parameter ``softmax_offset`` ``[heads]``) appends it as one more
column of the scores (``SoftmaxOne``).

A sink is one more term of the online softmax, so it is applied once per row to the merged result
over all keys, on any kernel and after any communication pattern: from ``(out, lse)``

    lse' = logaddexp(lse, σ_h),   out' = out · exp(lse − lse')

and the attention's own backward, given ``(out', lse')`` instead of ``(out, lse)``, returns the
gradients of q, k, v with the sink in the denominator (the kernels form ``P = exp(s − lse')`` and
``D = rowsum(dout · out')``, exactly the sink-softmax's).  The sink's gradient is
``dσ_h = −Σ_rows exp(σ_h − lse') · ⟨dout, out'⟩`` over the rows this rank holds: the gradient of a
rank's share, which the data-parallel reduction over the CP ranks sums (Megatron's DDP reduces
every gradient over ``dp_cp``), so nothing here communicates.  Layout: ``[b, s, h, d]``, lse
``[b, h, s]``.
"""

from __future__ import annotations

import torch

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def check_softmax_offset(softmax_offset: torch.Tensor | None, q: torch.Tensor, head_dim: int) -> None:
    """``softmax_offset`` is None or a floating ``[h_q]`` tensor on q's device (``head_dim``: q's heads dim)."""
    if softmax_offset is None:
        return
    heads = q.shape[head_dim]
    if not isinstance(softmax_offset, torch.Tensor) or tuple(softmax_offset.shape) != (heads,):
        shape = tuple(softmax_offset.shape) if isinstance(softmax_offset, torch.Tensor) else type(softmax_offset)
        raise ValueError(f"softmax_offset must be a [{heads}] tensor (one sink logit per query head of q); "
                         f"got {shape}")
    if not softmax_offset.dtype.is_floating_point or softmax_offset.device != q.device:
        raise ValueError(f"softmax_offset must be a floating tensor on q's device {q.device}; got "
                         f"{softmax_offset.dtype} on {softmax_offset.device}")


def add_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The result with the sink logit in the denominator: out ``[b, s, h, d_v]`` (any dtype), lse
    ``[b, h, s]`` (accumulator dtype), sink ``[h]`` -> out' (out's dtype), lse' (lse's dtype).

    A row that saw no key (``lse = -inf``, ``out = 0``) keeps ``out' = 0`` and gets ``lse' = σ``.
    """
    sigma = sink.detach().to(lse.dtype).view(1, -1, 1)  # [1, h, 1]
    new = torch.logaddexp(lse, sigma)  # [b, h, s]
    weight = torch.exp(lse - new).transpose(1, 2).unsqueeze(-1)  # [b, h, s] -> [b, s, h, 1]
    return (out.to(lse.dtype) * weight).to(out.dtype), new


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``dσ`` ``[h]`` (sink's dtype) of the rows held here, from dout and out' ``[b, s, h, d_v]`` and lse'
    ``[b, h, s]``."""
    acc = lse.dtype
    p_sink = torch.exp(sink.detach().to(acc).view(1, -1, 1) - lse)  # [b, h, s]: the sink's probability
    dot = torch.linalg.vecdot(dout.to(acc), out.to(acc), dim=-1).transpose(1, 2)  # [b, h, s]: <dout, out'> per row
    return -(p_sink * dot).sum(dim=(0, 2)).to(sink.dtype)  # [h]


def heads_of(sink: torch.Tensor | None, rank: int, size: int) -> torch.Tensor | None:
    """The sinks of head group ``rank`` of ``size`` (Ulysses' all-to-all hands rank ``r`` the ``r``-th
    contiguous group of query heads); differentiable, so the other heads' gradient is zero here."""
    if sink is None or size == 1:
        return sink
    per = sink.shape[0] // size
    return sink.narrow(0, rank * per, per)  # [h/U]
