"""megatron-longctx: million-token context for Megatron-Core pipelines, without forking Megatron.

The public API lives here; names that need Megatron-Core are imported on first use so that
``import megatron_longctx.kernels`` or ``.attention`` stays free of Megatron.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "apply_to_spec": "megatron_longctx.megatron.spec",
    "ContextParallelAttention": "megatron_longctx.megatron.core_attention",
    "add_longctx_args": "megatron_longctx.megatron.arguments",
    "config_from_args": "megatron_longctx.megatron.arguments",
    "LongContextConfig": "megatron_longctx.config",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_longctx' has no attribute {name!r}")
