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

from typing import Any, Callable

from megatron_longctx.config import LongContextConfig
from megatron_longctx.megatron.attention_spec import core_attention_spec, self_attention_rule  # noqa: F401
from megatron_longctx.megatron.spec_walk import KEEP, built_class, walk_spec


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
    that change the spec go through their feature's spec edit (:mod:`megatron_longctx.megatron.features`).
    Raises ``ValueError`` when the spec holds no self-attention to replace.
    """
    return transform_spec(spec, _options_to_config(config, options), require=True)


def transform_spec(spec: Any, cfg: LongContextConfig, require: bool = True) -> Any:
    """:func:`apply_to_spec` with a ready config (:meth:`LongContextPlugin.spec`); ``require=False`` passes a
    spec without attention through."""
    from megatron_longctx.megatron.plugin import LongContextPlugin

    return LongContextPlugin(cfg).spec(spec, require=require)


def build_model(build: Callable[[Any, dict[str, Any]], Any], config: Any, specs: dict[str, Any],
                cfg: LongContextConfig, who: str = "megatron-longctx") -> Any:
    """Build a Megatron model with the plugin in it (:meth:`LongContextPlugin.build`): the launcher's and
    the main job's path.

    ``build(config, specs)`` builds the model (``GPTModel(config, **specs)`` or the like) and returns it;
    ``specs`` maps its spec arguments (layer / stack spec, MTP block spec; ``None`` entries are passed
    through).  The installation is ``model._longctx_memory_handle``.
    """
    from megatron_longctx.megatron.plugin import LongContextPlugin

    return LongContextPlugin(cfg).build(build, config, specs, who)


def count_context_parallel_attention(spec: Any) -> int:
    """How many ``core_attention`` entries of ``spec`` are ContextParallelAttention (for checks and tests)."""
    from megatron_longctx.megatron.core_attention import ContextParallelAttention

    def rule(submodules: Any, name: str, entry: Any) -> Any:
        return entry if name == "core_attention" and built_class(entry) is ContextParallelAttention else KEEP

    return walk_spec(spec, rule)[1]


