"""RMSNorm that keeps only its input and ``1/rms`` for backward, as fused norms do.

torch's ``nn.RMSNorm`` (what Megatron's local spec builds without apex or Transformer Engine, through
``WrappedTorchNorm``) runs as separate operators on CPU, and autograd keeps their intermediates: the
normalised input, the product before the weight, and the square for the power's backward, about
three hidden-size tensors per token for each norm.  A fused norm (TE's ``RMSNorm``, apex's
``FusedRMSNorm``) keeps its input, usually alive anyway as the residual, and one float32 per token.
:func:`lean_rms_norm` does the same in plain PyTorch, the normalised input recomputed in backward;
the statistics are float32 (float64 for float64 inputs).  :func:`install_lean_norms` swaps it into the
``nn.RMSNorm`` modules of a model (same parameters and ``state_dict``); ``--longctx-lean-norm`` turns
it on.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from megatron_longctx.memory import grad_buffers
from megatron_longctx.patching import patch


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _stats(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1/rms`` of the last dimension, ``[..., 1]``, in float32 (float64 for float64)."""
    return torch.rsqrt(x.to(_acc(x)).pow(2).mean(-1, keepdim=True) + eps)


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
        rstd = _stats(x, eps)  # [..., 1]
        y = (x.to(rstd.dtype) * rstd).to(x.dtype)
        if weight is not None:
            y = y * weight
        ctx.save_for_backward(x, weight, rstd)
        ctx.watch = grad_buffers.Watch(x)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        h = x.shape[-1]
        x2, dy2, rstd2 = x.reshape(-1, h), dy.reshape(-1, h), rstd.reshape(-1, 1)  # [n, h], [n, h], [n, 1]
        # dx in dy's buffer when it is a plugin's own (each step reads its rows of dy before writing them)
        dx = dy2 if grad_buffers.reusable(dy, x.shape, x.dtype, x.device) else torch.empty_like(x2)  # [n, h]
        want_dw = weight is not None and ctx.needs_input_grad[1]
        dw = torch.zeros(h, dtype=rstd.dtype, device=x.device) if want_dw else None  # [h] in acc
        for lo in range(0, x2.shape[0], BACKWARD_ROWS):
            hi = min(lo + BACKWARD_ROWS, x2.shape[0])
            _rows_backward(x2[lo:hi], dy2[lo:hi], rstd2[lo:hi], weight, dx[lo:hi], dw)
        return grad_buffers.own(dx.view(x.shape), ctx.watch), None if dw is None else dw.to(weight.dtype), None


# Rows (tokens) per step of the backward: its float32 buffers are [rows, h], not [tokens, h].
BACKWARD_ROWS = 1024


def _rows_backward(x: torch.Tensor, dy: torch.Tensor, rstd: torch.Tensor, weight: Optional[torch.Tensor],
                   dx: torch.Tensor, dw: Optional[torch.Tensor]) -> None:
    """``dx`` (written) and ``dw`` (accumulated) of rows ``x`` ``[r, h]``; two ``[r, h]`` buffers of its own.

    xhat and g, the rest in place in them (the weight gradient's product dies before g is made; products
    with xhat or the weight promote a low-precision dy without a copy of it).  ``dx`` may be ``dy`` itself
    (dy is read before dx is written); otherwise dy is never written.
    """
    acc = rstd.dtype
    xhat = x.to(acc) * rstd  # [r, h]
    if weight is not None:
        if dw is not None:
            dw.add_((dy * xhat).sum(0))  # [h]
        g = dy * weight.to(acc)  # [r, h] in acc
    else:
        g = dy.to(acc, copy=True)  # [r, h]
    # d/dx of x*rstd: rstd * (g - xhat * mean(g * xhat)); the row dot product as a batched
    # [1, h] @ [h, 1] matmul makes no [r, h] product
    mean = torch.matmul(g.unsqueeze(-2), xhat.unsqueeze(-1)).squeeze(-1).div_(x.shape[-1])  # [r, 1]
    dx.copy_(g.sub_(xhat.mul_(mean)).mul_(rstd))  # [r, h]


def lean_rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension; backward keeps ``x`` and ``1/rms`` only."""
    return _LeanRMSNorm.apply(x, weight, eps)


def _eps(module: torch.nn.RMSNorm) -> float:
    return torch.finfo(torch.float32).eps if module.eps is None else float(module.eps)


def _swap(module: torch.nn.RMSNorm) -> Callable[[], None]:
    if len(module.normalized_shape) != 1:
        raise ValueError(f"--longctx-lean-norm: RMSNorm over {tuple(module.normalized_shape)} (more than the last "
                         "dimension) is not supported; drop the flag")

    def forward(x: torch.Tensor) -> torch.Tensor:
        return lean_rms_norm(x, module.weight, _eps(module))

    return patch(module, "forward", forward, "--longctx-lean-norm: keeps its input and 1/rms only").undo


def install_lean_norms(modules: Iterable[torch.nn.Module]) -> list[Callable[[], None]]:
    """Every ``nn.RMSNorm`` inside ``modules`` runs :func:`lean_rms_norm`; returns one remover per norm.

    Norms of other types (TE's, apex's: already fused; LayerNorm) are left as they are.
    """
    seen: set[int] = set()
    removers = []
    for root in modules:
        for module in root.modules():
            if type(module) is torch.nn.RMSNorm and id(module) not in seen:
                seen.add(id(module))
                removers.append(_swap(module))
    return removers
