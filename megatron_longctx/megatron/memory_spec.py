"""The memory features' public entry points, kept as thin wrappers over the plugin object.

Each feature is one installer in :mod:`megatron_longctx.megatron.features` (the order and why:
``features/__init__.py``); :class:`~megatron_longctx.megatron.plugin.LongContextPlugin` runs them.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_longctx.config import LongContextConfig, MemoryConfig
from megatron_longctx.megatron.features.offload import OFFLOAD_TARGETS, release_embedding_output  # noqa: F401
from megatron_longctx.megatron.features.recompute import check_tiled_replay as _check_tiled_replay  # noqa: F401
from megatron_longctx.megatron.plugin import Installation, LongContextPlugin

MemoryHandle = Installation  # the name callers knew


def _plugin(cfg: MemoryConfig, who: str) -> LongContextPlugin:
    if not isinstance(cfg, MemoryConfig):
        raise ValueError(f"{who}: cfg must be a MemoryConfig, got {type(cfg).__name__}")
    return LongContextPlugin(LongContextConfig(memory=cfg))


def apply_memory_to_layer_spec(layer_spec: Any, cfg: MemoryConfig) -> Any:
    """A copy of a layer spec (or any spec tree holding layer specs) with the spec-level memory features
    applied (today the tiled MLP, ``--longctx-tiled-mlp-tiles`` > 1); no attention is replaced."""
    return _plugin(cfg, "apply_memory_to_layer_spec").memory_spec(layer_spec)


def install(model: Any, cfg: MemoryConfig) -> Installation:
    """Put the memory features of ``cfg`` on a built Megatron model (:meth:`LongContextPlugin.install`)."""
    return _plugin(cfg, "install").install(model)


def megatron_config_without_plugin_recompute(config: Any, cfg: MemoryConfig) -> Any:
    """``config`` as the model is built with it (:meth:`LongContextPlugin.model_config`)."""
    return _plugin(cfg, "megatron_config_without_plugin_recompute").model_config(config)


def install_and_report(model: Any, cfg: LongContextConfig, who: str = "megatron-longctx") -> Optional[Installation]:
    """:meth:`LongContextPlugin.install_and_report`."""
    return LongContextPlugin(cfg).install_and_report(model, who)
