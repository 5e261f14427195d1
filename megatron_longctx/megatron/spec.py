"""``apply_to_spec``: put :class:`ContextParallelAttention` into any Megatron-Core layer/block spec.

Megatron-Core wires a model from data: a ``ModuleSpec`` tree whose ``self_attention`` entries hold
``SelfAttentionSubmodules`` / ``MLASelfAttentionSubmodules`` with a ``core_attention`` slot.  The
transform walks that tree and returns a copy in which every dense self-attention ``core_attention``
is our module; the input spec is not touched.  It walks what Megatron's spec builders produce in
0.16 and 0.19 alike: ``ModuleSpec``, submodule dataclasses (``TransformerLayerSubmodules``,
``TransformerBlockSubmodules.layer_specs``, ``HybridStackSubmodules``/``MambaStackSubmodules``, MoE
and MTP specs), lists and ``functools.partial`` builders.  Left alone: cross-attention, and
attention variants that are not dense softmax attention (a ``core_attention`` spec with its own
submodules, e.g. DeepSeek sparse attention's indexer).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from megatron_longctx.config import ContextParallelConfig, LongContextConfig
from megatron_longctx.megatron.spec_walk import KEEP, built_class, is_module_spec, walk_spec

# Submodule dataclasses whose core_attention is cross-attention (kept as Megatron built it).
_CROSS_ATTENTION_SUBMODULES = ("CrossAttentionSubmodules",)


def _is_dense_core_attention(entry: Any) -> bool:
    """True for softmax attention that our module can stand in for."""
    if is_module_spec(entry) and entry.submodules is not None:
        return False  # a variant with its own submodules (sparse attention indexer, ...)
    return True


def _self_attention_rule(replacement: Any):
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


def _options_to_config(config: LongContextConfig | None, options: dict[str, Any]) -> LongContextConfig:
    if config is not None and options:
        raise ValueError("apply_to_spec: give either config= or keyword options, not both")
    if config is not None:
        if not isinstance(config, LongContextConfig):
            raise TypeError(f"apply_to_spec: config must be a LongContextConfig, got {type(config).__name__}")
        return config
    return LongContextConfig.from_flat(options)


def apply_to_spec(spec: Any, *, config: LongContextConfig | None = None, **options: Any) -> Any:
    """Return a copy of ``spec`` whose self-attention ``core_attention`` entries are ContextParallelAttention.

    ``spec``: any Megatron-Core spec object (a layer ``ModuleSpec``, ``TransformerBlockSubmodules``, a
    block/stack ``ModuleSpec`` such as the HybridModel/Mamba stack spec, a list of layer specs).
    ``options``: ``--longctx-*`` field names (``cp_algorithm="ring"``, ``cp_kernel_backend=...``, memory
    options such as ``tiled_mlp_tiles=4``), or one ``config=LongContextConfig(...)``.  Memory options
    that change the spec go through :func:`megatron_longctx.megatron.memory_spec.apply_memory_to_layer_spec`.
    Raises ``ValueError`` when the spec holds no self-attention to replace.
    """
    return transform_spec(spec, _options_to_config(config, options), require=True)


def transform_spec(spec: Any, cfg: LongContextConfig, require: bool = True) -> Any:
    """:func:`apply_to_spec` with a ready config; ``require=False`` passes a spec without attention through."""
    out, replaced = walk_spec(spec, _self_attention_rule(core_attention_spec(cfg.cp)))
    if replaced == 0 and require:
        raise ValueError(f"apply_to_spec found no self-attention core_attention in {type(spec).__name__}; pass a "
                         "Megatron layer spec (e.g. get_gpt_layer_local_spec()), block spec or stack spec")
    if cfg.memory.any_enabled:
        from megatron_longctx.megatron.memory_spec import apply_memory_to_layer_spec

        out = apply_memory_to_layer_spec(out, cfg.memory)
    return out


def build_model(build: Callable[[Any, dict[str, Any]], Any], config: Any, specs: dict[str, Any],
                cfg: LongContextConfig, who: str = "megatron-longctx") -> Any:
    """Build a Megatron model with the plugin in it: the one path of the launcher and the main job.

    ``build(config, specs)`` builds the model (``GPTModel(config, **specs)`` or the like) and returns it;
    ``specs`` maps its spec arguments (layer / stack spec, MTP block spec; ``None`` entries are passed
    through).  In this order:

    1. every spec gets :class:`ContextParallelAttention` and the spec-level memory features
       (:func:`transform_spec`);
    2. where the plugin runs Megatron's recompute, the model is built with Megatron's off
       (:func:`~megatron_longctx.megatron.memory_spec.megatron_config_without_plugin_recompute`), so ``install`` does not refuse the pair;
    3. :func:`~megatron_longctx.megatron.memory_spec.install` puts the memory features on the built model; the handle is
       ``model._longctx_memory_handle``, and rank 0 prints one line naming each feature and where it went.
    """
    from megatron_longctx.megatron.memory_spec import install_and_report, megatron_config_without_plugin_recompute

    specs = {name: None if spec is None else transform_spec(spec, cfg, require=False) for name, spec in specs.items()}
    model = build(megatron_config_without_plugin_recompute(config, cfg.memory), specs)
    install_and_report(model, cfg, who)
    return model


def count_context_parallel_attention(spec: Any) -> int:
    """How many ``core_attention`` entries of ``spec`` are ContextParallelAttention (for checks and tests)."""
    from megatron_longctx.megatron.core_attention import ContextParallelAttention

    def rule(submodules: Any, name: str, entry: Any) -> Any:
        return entry if name == "core_attention" and built_class(entry) is ContextParallelAttention else KEEP

    return walk_spec(spec, rule)[1]


