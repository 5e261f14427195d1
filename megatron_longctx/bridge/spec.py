"""The layer-spec object a Megatron-Bridge (or megatron-core ``GPTModelConfig``) model config holds.

Both model configs take ``transformer_layer_spec`` as a ``ModuleSpec`` or as a callable
``(model_config[, vp_stage]) -> ModuleSpec`` that the model builder calls once per (virtual pipeline)
stage.  :class:`LongContextLayerSpec` is such a callable, and an importable dataclass of plain values,
so Bridge's ``run_config.yaml`` writes it as ``_target_: megatron_longctx.bridge.spec.LongContextLayerSpec``
with its fields and loads it back (a closure would be written as ``__main__.main.<locals>.f``, which
cannot be loaded).  It wraps the recipe's own spec (``base``) and returns a fresh copy with our
attention (and the spec-level memory features) each call, so nothing Megatron edits in place later
reaches the recipe's spec.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
from typing import Any, Optional

from megatron_longctx.config import LongContextConfig

TARGET = "megatron_longctx.bridge.spec.LongContextLayerSpec"


def allow_in_run_config() -> None:
    """Let Megatron's (and Bridge's) config loader instantiate :class:`LongContextLayerSpec` from
    ``run_config.yaml``: its ``_target_`` allowlist takes only ``megatron.*`` unless told (this one target
    exactly).  Nothing to do where megatron.training is absent."""
    with contextlib.suppress(ImportError):
        importlib.import_module("megatron.training.config.instantiate_utils").target_allowlist.add_exact(TARGET)


@dataclasses.dataclass
class LongContextLayerSpec:
    """``transformer_layer_spec`` value: ``base`` with every self-attention ``core_attention`` ours.

    ``base``: the recipe's spec: a ``ModuleSpec``, a spec callable ``(config[, vp_stage])`` (an
    importable function such as Bridge's ``default_layer_spec``), or ``None`` for megatron-core's
    ``GPTModelConfig`` default choice.  ``options``: the ``--longctx-*`` field names and values
    (:meth:`LongContextConfig.from_flat`), kept as plain values so they survive ``run_config.yaml``.
    """

    base: Any = None
    options: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.base, LongContextLayerSpec):  # configure() twice: wrap the recipe's spec once
            self.options = {**self.base.options, **self.options}
            self.base = self.base.base
        self.options = dict(self.options)
        self.config()  # a bad option fails here, where the spec is made, not at the model build

    def config(self) -> LongContextConfig:
        """The validated typed config of :attr:`options` (``ValueError`` names the option)."""
        return LongContextConfig.from_flat(self.options)

    def base_spec(self, model_config: Any, vp_stage: Optional[int] = None) -> Any:
        """The recipe's own spec for this stage, as the model builder would have used it."""
        base = self.base
        if base is None:
            from megatron.training.models.gpt import default_layer_spec

            return default_layer_spec(model_config, vp_stage)
        if callable(base) and not hasattr(base, "submodules"):
            if "vp_stage" in inspect.signature(base).parameters:
                return base(model_config, vp_stage=vp_stage)
            return base(model_config)
        return base

    def __call__(self, model_config: Any, vp_stage: Optional[int] = None) -> Any:
        from megatron_longctx.megatron.plugin import LongContextPlugin

        base = self.base_spec(model_config, vp_stage)
        try:
            return LongContextPlugin(self.config()).spec(base, require=True)
        except ValueError as err:
            if "found no self-attention" not in str(err):
                raise
            raise ValueError(f"model.transformer_layer_spec: the recipe's spec ({_describe(self.base)}) has no "
                             "self-attention core_attention for megatron-longctx to replace (a full Transformer "
                             "Engine layer fuses attention into one module); set "
                             "model.use_transformer_engine_full_layer_spec=false or use a local / Transformer "
                             "Engine layer spec") from None


def _describe(base: Any) -> str:
    if base is None:
        return "the default"
    name = getattr(base, "__qualname__", None)
    return f"{getattr(base, '__module__', '')}.{name}" if name else type(base).__name__
