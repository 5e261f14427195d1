"""Megatron's optimizer with its inner AdamW replaced by the off-device one (``--longctx-model-state-offload``).

``get_megatron_optimizer`` wraps a torch optimizer (``torch.optim.AdamW``, or TE's / Apex's fused Adam in
AdamW mode) in ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params`` or the ``DistributedOptimizer``
(several of them in a ``ChainedOptimizer``).  Those wrappers do the loss scaling, the fp32 master copies of
bf16 parameters, the gradient clipping and the copies back, and call ``self.optimizer.step()`` in between.
:func:`install` replaces that inner optimizer of each wrapper by an
:class:`~megatron_longctx.memory.offdevice_optimizer.OffDeviceAdamW` over the same parameter groups (the
same dicts: the learning-rate scheduler keeps setting ``lr`` and ``weight_decay`` in them), carrying over any
state the inner one had.  Everything around the inner step stays Megatron's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_longctx.memory.offdevice_optimizer import FLAG, OffDeviceAdamW, OffDeviceSpec
from megatron_longctx.patching import Patch, patch

_ADAM_STATE = {"step", "exp_avg", "exp_avg_sq"}


@dataclasses.dataclass
class Installed:
    """The off-device optimizers :func:`install` put in place; :meth:`remove` puts Megatron's back."""

    optimizers: list[OffDeviceAdamW]
    patches: list[Patch]

    def remove(self) -> None:
        for p in self.patches:
            p.undo()
        for opt in self.optimizers:
            opt.close()


def megatron_optimizers(optimizer: Any) -> list[Any]:
    """The wrappers holding an inner torch optimizer (a ``ChainedOptimizer``'s members, or ``optimizer``)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    return [o for c in chained for o in megatron_optimizers(c)] if chained is not None else [optimizer]


def _check(inner: Any) -> None:
    name = type(inner).__name__
    if name == "HybridDeviceOptimizer":
        raise ValueError(f"{FLAG} keeps the optimizer off the device itself: drop Megatron's "
                         "--optimizer-cpu-offload")
    adam_w = isinstance(inner, torch.optim.AdamW) or (
        "adam" in name.lower() and inner.defaults.get("adam_w_mode", False) and not isinstance(inner, torch.optim.Adam))
    if not adam_w:
        raise ValueError(f"{FLAG} replaces Megatron's AdamW; this run's optimizer is {name}: use --optimizer adam "
                         "with decoupled weight decay (Megatron's default)")


def install(optimizer: Any, spec: OffDeviceSpec) -> Installed:
    """Replace the inner optimizer of every wrapper in ``optimizer`` (built by ``get_megatron_optimizer``)."""
    done = Installed([], [])
    try:
        for wrapper in megatron_optimizers(optimizer):
            inner = wrapper.optimizer
            _check(inner)
            d = inner.defaults
            new = OffDeviceAdamW(inner.param_groups, spec, lr=d["lr"], betas=d["betas"], eps=d["eps"],
                                 weight_decay=d["weight_decay"])
            done.optimizers.append(new)
            state = inner.state_dict()
            if state["state"]:
                extra = {k for s in state["state"].values() for k in s} - _ADAM_STATE
                if extra:
                    raise ValueError(f"{FLAG}: the optimizer state holds {sorted(extra)} beside Adam's moments; "
                                     "install the off-device optimizer before any precision-aware state exists")
                new.load_state_dict(state)
            done.patches.append(patch(wrapper, "optimizer", new, reason=f"{FLAG}: AdamW with its state off the device"))
    except BaseException:
        done.remove()
        raise
    return done
