"""Which block kernel serves a call: by name, or automatically by device and availability.

Automatic order: CUDA ``flash_attn`` > ``sdpa_cuda`` > ``reference``; CPU ``cpu_flash`` >
``reference``; any other device ``reference``.  Automatic selection moves to the next backend when
one cannot serve a case (its ``check`` gives the reason); a backend asked for by name that cannot
serve the case raises :class:`~.base.KernelUnsupported` with that reason, never computing with
another backend behind the caller's back.  On CUDA automatic selection never lands on the O(s²)
``reference`` (float32 blocks, say): it refuses in one line naming the dtype flags and the backends that
serve them (float64, the test oracle's dtype, and ``reference`` asked for by name are served).
"""

from __future__ import annotations

import types

import torch

from . import cpu_flash, flash_attn, reference, sdpa_cuda
from .base import BlockArgs, KernelUnsupported

BACKENDS: dict[str, types.ModuleType] = {m.name: m for m in (reference, cpu_flash, sdpa_cuda, flash_attn)}

AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash_attn", "sdpa_cuda", "reference"),
    "cpu": ("cpu_flash", "reference"),
}


def _backend(name: str) -> types.ModuleType:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(BACKENDS)} or None (automatic)")


def auto_order(device: torch.device | str) -> tuple[str, ...]:
    """Backend names tried, in order, for tensors on ``device``."""
    return AUTO_ORDER.get(torch.device(device).type, ("reference",))


def get_kernel(name: str | None, device: torch.device | str) -> types.ModuleType:
    """The backend called ``name`` (``None``: the first usable one for ``device``).

    Raises ``ValueError`` for an unknown name and :class:`KernelUnsupported` when the named backend
    cannot run on ``device`` (not installed, wrong device type), with the reason.
    """
    device = torch.device(device)
    if name is not None:
        backend = _backend(name)
        reason = backend.available(device)
        if reason is not None:
            raise KernelUnsupported(f"attention kernel {name!r} is unavailable: {reason}")
        return backend
    for candidate in auto_order(device):
        backend = BACKENDS[candidate]
        if backend.available(device) is None:
            return backend
    return reference


def kernel_for(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: BlockArgs, preferred: str | None = None
) -> types.ModuleType:
    """The backend that computes this block: ``preferred`` if given (or raise), else automatic.

    ``preferred``: a name from :data:`BACKENDS`; when it cannot serve the case this raises
    :class:`KernelUnsupported` naming the backend and the reason.  Automatic selection returns the
    first backend of :func:`auto_order` whose ``check`` accepts the case (``reference`` accepts all).
    """
    if preferred is not None:
        backend = _backend(preferred)
        reason = backend.check(q, k, v, args)
        if reason is not None:
            raise KernelUnsupported(f"attention kernel {preferred!r} cannot serve this block: {reason}")
        return backend
    reasons = []
    for candidate in auto_order(q.device):
        if candidate == "reference" and q.device.type == "cuda" and q.dtype != torch.float64:
            raise KernelUnsupported(
                f"{q.dtype} attention on CUDA: no fast kernel serves this block ({'; '.join(reasons)}); train with "
                "--bf16 or --fp16 (flash_attn, sdpa_cuda), or pass --longctx-cp-kernel-backend reference for the "
                "O(s^2) reference kernel")
        backend = BACKENDS[candidate]
        reason = backend.check(q, k, v, args)
        if reason is None:
            return backend
        reasons.append(f"{candidate}: {reason}")
    raise KernelUnsupported("no attention kernel serves this block: " + "; ".join(reasons))
