"""Activation memory for long context: offload, recompute, tiled MLP, tiled logits + loss, accounting.

The mechanisms, on plain modules and tensors. Wiring them into a Megatron model (spec changes, hooks on a
built model) is :mod:`megatron_longctx.megatron.memory_spec`.

* :class:`MemoryConfig` — the typed configuration (``--longctx-*`` flags; defined in
  :mod:`megatron_longctx.config` with every feature config).
"""

from __future__ import annotations

import importlib

from megatron_longctx.config import MemoryConfig  # noqa: F401 - public name (defined with every feature config)

_LAZY = {
    "ActivationOffloader": "megatron_longctx.memory.offload",
    "tiled_logits_loss": "megatron_longctx.memory.tiled_loss",
    "SavedTensorAccountant": "megatron_longctx.memory.accounting",
}

__all__ = sorted([*_LAZY, "MemoryConfig"])


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_longctx.memory' has no attribute {name!r}")
