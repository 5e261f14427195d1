"""megatron-longctx: million-token context for Megatron-Core pipelines, without forking Megatron.

The public API lives here; names that need Megatron-Core are imported on first use so that
``import megatron_longctx.kernels`` or ``.attention`` stays free of Megatron.
"""

from __future__ import annotations

from megatron_longctx.lazy import attributes

__version__ = "0.1.0"

_LAZY = {
    "apply_to_spec": "megatron_longctx.megatron.spec",
    "ContextParallelAttention": "megatron_longctx.megatron.core_attention",
    "add_longctx_args": "megatron_longctx.megatron.arguments",
    "config_from_args": "megatron_longctx.megatron.arguments",
    "LongContextConfig": "megatron_longctx.config",
}

__all__ = sorted(_LAZY)


__getattr__ = attributes(__name__, _LAZY)
