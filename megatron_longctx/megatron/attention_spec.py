"""The spec edit that puts :class:`ContextParallelAttention` into every dense self-attention
``core_attention`` of a Megatron-Core spec (:meth:`LongContextPlugin.spec` applies it)."""

from __future__ import annotations

from typing import Any

from megatron_longctx.config import ContextParallelConfig
from megatron_longctx.megatron.spec_walk import KEEP, is_module_spec

# Submodule dataclasses whose core_attention is cross-attention (kept as Megatron built it).
_CROSS_ATTENTION_SUBMODULES = ("CrossAttentionSubmodules",)


def _is_dense_core_attention(entry: Any) -> bool:
    """True for softmax attention that our module can stand in for."""
    if is_module_spec(entry) and entry.submodules is not None:
        return False  # a variant with its own submodules (sparse attention indexer, ...)
    return True


def self_attention_rule(replacement: Any):
    def rule(submodules: Any, name: str, entry: Any) -> Any:
        if (name == "core_attention" and type(submodules).__name__ not in _CROSS_ATTENTION_SUBMODULES
                and _is_dense_core_attention(entry)):
            return replacement
        return KEEP

    return rule


def core_attention_spec(cp_config: ContextParallelConfig | None = None) -> Any:
    """The ``ModuleSpec`` of :class:`ContextParallelAttention` with ``cp_config`` as its parameter."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_longctx.megatron.core_attention import ContextParallelAttention

    return ModuleSpec(module=ContextParallelAttention, params={"cp_config": cp_config or ContextParallelConfig()})
