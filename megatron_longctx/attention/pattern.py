"""The autograd of every communication pattern: the pattern's forward and backward, with the attention
sinks (:mod:`.sinks`) applied once to the merged result and their gradient taken from it."""

from __future__ import annotations

import torch

from .block_loop import Rows
from .sinks import add_sink, sink_grad


class PatternAttention(torch.autograd.Function):
    """Autograd of one communication pattern, ``apply(q, k, v, group, plan, args, sink)``: a subclass names
    the pattern's ``pattern_forward(q, k, v, group, plan, args) -> (out, lse)`` and ``pattern_backward(rows, k,
    v, group, plan, args) -> (dq, dk, dv)`` (``rows``: :class:`.block_loop.Rows`); ``sink`` ``[h_q]`` or None
    is added to each row's merged result and saved with it."""

    @staticmethod
    def pattern_forward(q, k, v, group, plan, args):  # pragma: no cover - each pattern defines it
        raise NotImplementedError

    @staticmethod
    def pattern_backward(rows, k, v, group, plan, args):  # pragma: no cover
        raise NotImplementedError

    @classmethod
    def forward(cls, ctx, q, k, v, group, plan, args, sink=None):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = cls.pattern_forward(q, k, v, group, plan, args)
        if sink is not None:
            out, lse = add_sink(out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.group, ctx.plan, ctx.args = group, plan, args
        return out

    @classmethod
    def backward(cls, ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = cls.pattern_backward(Rows(q, out, lse, dout), k, v, ctx.group, ctx.plan, ctx.args)
        dsink = sink_grad(dout, out, lse, sink) if any(ctx.needs_input_grad[6:]) else None  # [h_q]
        return dq, dk, dv, None, None, None, dsink
