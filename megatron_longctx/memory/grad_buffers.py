"""The residual stream's gradient in one buffer: a plugin backward writes its input's gradient into the
buffer of its output's gradient when that buffer is the plugin's own.

Backward through a layer holds its output's gradient and builds its input's: two hidden-sized tensors per
token.  The plugin's token-wise backwards (the tiled replay, the lean norm) consume the output gradient a
block of rows at a time and write the input gradient of the same rows, so they may write it into the rows
just consumed: :func:`own` marks the buffer a plugin backward made for its input's gradient when nothing but
autograd can see that gradient (:class:`Watch`), and the next plugin backward, given it as its output's
gradient, writes into it (:func:`reusable`).  Any other gradient (Megatron's, or one that autograd summed
from several consumers into a new tensor) is never written.  :class:`ParamGrads` does the same for
parameter gradients summed over tiles, through Megatron's ``main_grad`` protocol.
Where the feature uses it: docs/memory-features.md (``--longctx-recompute-tiles``).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

_OWNED = "_longctx_owned_grad"


def _private(x: torch.Tensor) -> bool:
    """Whether only autograd sees the gradient of ``x`` (no ``.grad``, no tensor hooks)."""
    return x.grad_fn is not None and not x.retains_grad and not x._backward_hooks


class Watch:
    """Taken at forward on a plugin function's input: may its gradient buffer be marked as owned?

    Only when nothing but autograd can see the input's gradient: the input is not a leaf (a leaf's gradient
    becomes its ``.grad``), does not retain its gradient and has no tensor hooks, here at forward and, if it is
    still alive, at backward (:meth:`private`).
    """

    __slots__ = ("_ref",)

    def __init__(self, x: torch.Tensor) -> None:
        self._ref: Optional[weakref.ref] = weakref.ref(x) if x.requires_grad and _private(x) else None

    def private(self) -> bool:
        if self._ref is None:
            return False
        x = self._ref()
        return x is None or _private(x)


def own(grad: torch.Tensor, watch: Watch) -> torch.Tensor:
    """``grad`` (a fresh buffer the caller made for its input's gradient), marked as reusable when the
    input's gradient is private (see :class:`Watch`)."""
    if watch.private():
        setattr(grad, _OWNED, True)
    return grad


def reusable(grad: Optional[torch.Tensor], shape: torch.Size, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the incoming output gradient ``grad`` may be overwritten with an input gradient of this
    shape, dtype and device."""
    return (grad is not None and getattr(grad, _OWNED, False) and grad.shape == shape and grad.dtype == dtype
            and grad.device == device and grad.is_contiguous())


def main_grad_of(param: torch.Tensor) -> Optional[torch.Tensor]:
    """``param``'s Megatron ``main_grad`` when a gradient may be added into it directly, else ``None``.

    Megatron's DDP gives each parameter a float32 ``main_grad`` and, once ``grad_added_to_main_grad`` is set,
    skips adding the gradient autograd hands it (its gradient-accumulation-fusion protocol), so a gradient
    summed over tiles can go there with no sum of the plugin's own held beside it.
    """
    main = getattr(param, "main_grad", None)
    if (main is None or not hasattr(param, "grad_added_to_main_grad") or main.shape != param.shape
            or main.dtype != torch.float32):
        return None
    return main


_PLACEHOLDERS: dict = {}  # (shape, dtype, device) -> the one placeholder buffer of that kind


def main_grad_placeholder(param: torch.Tensor) -> torch.Tensor:
    """What a backward returns for ``param`` once it added the gradient into ``main_grad`` itself: an
    unread tensor of its shape (zeros under ``zero_out_wgrad``), with ``grad_added_to_main_grad`` set.

    One buffer per shape, dtype and device serves every call (as TE's dummy weight gradient): a
    parameter-sized allocation per parameter per backward would be ~1 GiB for a 128K-vocabulary bf16
    output weight.  It is returned as a new tensor on that buffer's storage (``detach``), which autograd's
    ``AccumulateGrad`` takes as ``.grad`` without copying it (a tensor referenced elsewhere is cloned);
    Megatron's gradient hook then sets ``.grad`` to ``None``.
    """
    key = (tuple(param.shape), param.dtype, param.device)
    buf = _PLACEHOLDERS.get(key)
    if buf is None:
        buf = _PLACEHOLDERS[key] = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    if getattr(param, "zero_out_wgrad", False):
        buf.zero_()  # Megatron adds this one into main_grad
    param.grad_added_to_main_grad = True
    return buf.detach()


class ParamGrads:
    """Parameter gradients summed over tiles: straight into Megatron's ``main_grad`` where its DDP allows
    (no sum of our own alongside each tile's gradients), else summed here; :meth:`result` is what the
    backward returns for them.

    The protocol also runs the other way inside a tile: with ``gradient_accumulation_fusion`` Megatron's
    linears (TE's and apex's too) add their weight gradient into ``main_grad`` themselves, set
    ``grad_added_to_main_grad`` and return an unread placeholder (``tensor_parallel/layers.py``,
    ``LinearWithGradAccumulationAndAsyncCommunication.backward``); :meth:`grad` clears the flag before each
    tile's ``torch.autograd.grad`` and drops what it returns for a parameter whose flag the tile set.
    """

    def __init__(self, params: tuple) -> None:
        self.params = params
        self.mains = [main_grad_of(p) for p in params]
        self.sums: list = [None] * len(params)
        self.added = [False] * len(params)  # some gradient of the parameter is in its main_grad
        self._flagged = [hasattr(p, "grad_added_to_main_grad") for p in params]
        self._flag_before = [bool(getattr(p, "grad_added_to_main_grad", False)) for p in params]

    def grad(self, outputs: Any, inputs: tuple, grad_outputs: Any) -> tuple:
        """``torch.autograd.grad(outputs, (*inputs, *params), grad_outputs)``: the parameters' gradients
        are added here, the inputs' returned.  A parameter whose ``grad_added_to_main_grad`` the call's
        backward set (a fused linear) has its gradient in ``main_grad`` already; what the call returned
        for it is a placeholder of unread memory and is dropped."""
        for p, flagged in zip(self.params, self._flagged):
            if flagged:
                p.grad_added_to_main_grad = False
        got = torch.autograd.grad(outputs, (*inputs, *self.params), grad_outputs, allow_unused=True)
        param_grads = list(got[len(inputs):])
        for i, (p, flagged) in enumerate(zip(self.params, self._flagged)):
            if flagged and p.grad_added_to_main_grad:
                param_grads[i] = None
                self.added[i] = True
        self.add(tuple(param_grads))
        for p, flagged, before, added in zip(self.params, self._flagged, self._flag_before, self.added):
            if flagged:
                p.grad_added_to_main_grad = before or added
        return got[:len(inputs)]

    def add(self, grads: tuple) -> None:
        for i, g in enumerate(grads):
            if g is None:
                continue
            if self.mains[i] is not None:
                self.mains[i].add_(g)
                self.added[i] = True
            else:
                self.sums[i] = g if self.sums[i] is None else self.sums[i].add_(g)

    def result(self) -> list:
        out = []
        for p, added, total in zip(self.params, self.added, self.sums):
            if added and total is not None:  # a fused linear's main_grad that main_grad_of refused (not float32)
                p.main_grad.add_(total)
            out.append(main_grad_placeholder(p) if added else total)
        return out
