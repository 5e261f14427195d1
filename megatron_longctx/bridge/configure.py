""":func:`configure`: a Megatron-Bridge ``ConfigContainer`` (or a model config) gains megatron-longctx.

Three things change on the model config, nothing else:

1. ``transformer_layer_spec`` becomes a :class:`~megatron_longctx.bridge.spec.LongContextLayerSpec`
   around the recipe's own spec (our attention in every self-attention ``core_attention``, the tiled
   MLP when asked); a hybrid model's ``hybrid_stack_spec`` (a ``ModuleSpec`` the builder takes as it is)
   becomes the transformed copy of the recipe's stack spec;
2. Megatron's recompute moves into the plugin where Megatron's own cannot serve the memory features
   (the launcher's rule, :func:`megatron_longctx.megatron.arguments.plugin_recompute`): the model config's
   ``recompute_*`` are then cleared and the plugin's typed config holds them;
3. a pre-wrap hook (:class:`LongContextModelHook`, run on the built model before DDP) checks that the
   model holds our attention in every layer and installs the memory features (offload, recompute, tiled
   loss) with :class:`megatron_longctx.megatron.plugin.LongContextPlugin`.

What cannot work together is refused up front, each error naming the config field and the value to use
(:func:`check_model_config`).  Works with Bridge's ``GPTModelProvider`` and megatron-core's
``GPTModelConfig`` alike (same field, same builder); importing this module needs neither Bridge nor
Megatron.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_longctx.bridge.spec import LongContextLayerSpec, allow_in_run_config
from megatron_longctx.config import LongContextConfig

PREFIX = "megatron_longctx.bridge"
# Megatron's recompute fields on a model config, cleared (by the plugin's model_config) when the plugin runs
# the recompute instead.
_MEGATRON_RECOMPUTE = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")


def configure(cfg: Any, **longctx_options: Any) -> Any:
    """Put megatron-longctx into ``cfg`` (a Bridge ``ConfigContainer``, or its ``model`` config); return ``cfg``.

    ``longctx_options``: the ``--longctx-*`` field names of :mod:`megatron_longctx.config`
    (``cp_algorithm="ring"``, ``offload_policy="checkpoint"``, ``tiled_mlp_tiles=4``, ...).  Calling it
    again (e.g. on a config loaded back from ``run_config.yaml``) keeps the options already there and
    adds the new ones.  Raises ``ValueError`` naming the field (``model.attention_backend``, ...) and
    the fix when the model config cannot run our attention or the memory features.
    """
    model = getattr(cfg, "model", cfg)
    hybrid = not hasattr(model, "transformer_layer_spec") and hasattr(model, "hybrid_stack_spec")
    if not hybrid and not hasattr(model, "transformer_layer_spec"):
        raise ValueError(f"{PREFIX}.configure: {type(model).__name__} has neither transformer_layer_spec nor "
                         "hybrid_stack_spec; pass a ConfigContainer whose model is a GPT or hybrid model provider "
                         "(GPTModelConfig / HybridModelConfig)")
    takes = _takes_distributed_optimizer(cfg, {**_existing_options(model), **longctx_options})
    if takes:  # the plugin runs it over the streamed states; Bridge builds DDP and its optimizer without it
        longctx_options = {**longctx_options, "distributed_optimizer": True}
    options = _with_plugin_recompute(model, longctx_options)
    moved = any(name in options and name not in longctx_options for name in _MEGATRON_RECOMPUTE)
    if hybrid:
        options = {**_existing_options(model), **options}
        longctx = _config(LongContextLayerSpec(options=options))
    else:
        spec = LongContextLayerSpec(base=model.transformer_layer_spec, options=options)
        longctx, options = _config(spec), spec.options
    check_model_config(model, longctx, recompute_moved=moved)
    if longctx.model_states.enabled:
        check_model_state_training(cfg, longctx)
    # made before anything changes: a refusal leaves the config as it was
    field, value = (("hybrid_stack_spec", _hybrid_stack_spec(model, longctx)) if hybrid
                    else ("transformer_layer_spec", spec))
    if moved:
        from megatron_longctx.megatron.plugin import LongContextPlugin

        cleared = LongContextPlugin(longctx).model_config(model)  # a copy with Megatron's recompute off
        for name in _MEGATRON_RECOMPUTE:
            if hasattr(model, name):
                setattr(model, name, getattr(cleared, name))
    if takes:
        cfg.ddp.use_distributed_optimizer = cfg.optimizer.use_distributed_optimizer = False
    setattr(model, field, value)
    if not hybrid:
        allow_in_run_config()  # this run writes it to run_config.yaml; a resume calls configure again
    _register_pre_wrap_hook(model, LongContextModelHook(options=options))
    return cfg


def _takes_distributed_optimizer(cfg: Any, options: dict) -> bool:
    """Bridge's distributed optimizer (``ddp`` / ``optimizer.use_distributed_optimizer``) beside
    ``model_state_offload``: its DDP buffers are the ones the streamer replaces, so the plugin runs it instead,
    sharding its off-device optimizer's states over the data x context parallel ranks."""
    if options.get("model_state_offload", "none") == "none":
        return False
    return any(getattr(getattr(cfg, section, None), "use_distributed_optimizer", False)
               for section in ("ddp", "optimizer"))


def _hybrid_stack_spec(model: Any, longctx: LongContextConfig) -> Any:
    """The hybrid model's stack spec (the recipe's, else megatron-core's default) with our attention."""
    from megatron_longctx.megatron.plugin import LongContextPlugin

    base = model.hybrid_stack_spec
    if base is None:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec as base
    try:
        return LongContextPlugin(longctx).spec(base, require=True)
    except ValueError as err:
        raise ValueError(f"{PREFIX}: model.hybrid_stack_spec: {err}") from None


def _existing_options(model: Any) -> dict[str, Any]:
    """The options of an earlier configure (a config loaded back from run_config.yaml keeps them)."""
    spec = getattr(model, "transformer_layer_spec", None)
    if isinstance(spec, LongContextLayerSpec):
        return dict(spec.options)
    hooks = getattr(model, "pre_wrap_hooks", None)
    hooks = hooks if isinstance(hooks, list) else getattr(model, "_pre_wrap_hooks", [])
    return next((dict(h.options) for h in hooks if isinstance(h, LongContextModelHook)), {})


def _with_plugin_recompute(model: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` plus the recompute the plugin must run in Megatron's place (``{}`` added: Megatron's own)."""
    from megatron_longctx.megatron.arguments import plugin_recompute

    merged = {**_existing_options(model), **options}
    if any(name in merged for name in _MEGATRON_RECOMPUTE):
        return dict(options)  # the plugin's recompute given explicitly: check_model_config checks the pair
    return {**options, **plugin_recompute(model, merged.get("offload_policy", "none"),
                                          merged.get("recompute_tiles", 0))}


def _config(spec: LongContextLayerSpec) -> LongContextConfig:
    try:
        return spec.config()
    except ValueError as err:
        raise ValueError(f"{PREFIX}.configure: {err}") from None


def _field_error(name: str, value: Any, message: str) -> ValueError:
    return ValueError(f"{PREFIX}: model.{name}={value!r}: {message}")


def check_model_config(model: Any, longctx: LongContextConfig, recompute_moved: bool = False) -> None:
    """Refuse what cannot run with our attention and memory features; each error names the field and fix.
    ``recompute_moved``: the plugin's recompute is the model config's own, moved (then cleared there)."""
    from megatron_longctx.megatron.arguments import _check_kernel_backend

    backend = getattr(model, "attention_backend", None)
    if getattr(backend, "name", backend) == "local":
        raise _field_error("attention_backend", "local",
                           "the model builder then puts Megatron's DotProductAttention back into the layer spec "
                           "in place of megatron-longctx's attention (and context parallelism asserts); set "
                           "model.attention_backend=auto")
    if getattr(model, "use_transformer_engine_full_layer_spec", False):
        raise _field_error("use_transformer_engine_full_layer_spec", True,
                           "a full Transformer Engine layer fuses attention into one module, leaving no "
                           "core_attention to replace; set it to false")
    cp_size = getattr(model, "context_parallel_size", 1) or 1
    dropout = getattr(model, "attention_dropout", 0.0) or 0.0
    if cp_size > 1 and dropout > 0:
        raise _field_error("attention_dropout", dropout,
                           f"megatron-longctx's attention has no dropout under context parallelism "
                           f"(model.context_parallel_size={cp_size}); set model.attention_dropout=0.0")
    if longctx.memory.offload_enabled:
        for name in ("cpu_offloading", "fine_grained_activation_offloading"):
            if getattr(model, name, False):
                raise _field_error(name, True, f"Megatron's activation offload would run together with "
                                               f"megatron-longctx's (offload_policy={longctx.memory.offload_policy!r}); "
                                               f"set model.{name}=false, or drop offload_policy")
    ms = longctx.model_states
    if ms.enabled:
        if getattr(model, "gradient_accumulation_fusion", False):
            raise _field_error("gradient_accumulation_fusion", True,
                               "Megatron's fused weight-gradient accumulation adds into the main_grad its forward "
                               "saw (the off-device copy), not the device slot the model-state offload's backward "
                               "streams through; set model.gradient_accumulation_fusion=false")
        if getattr(model, "cpu_offloading", False):
            raise _field_error("cpu_offloading", True, f"Megatron's offload would move the weights the model-state "
                                                        f"offload streams (model_state_offload={ms.model_state_offload!r}); "
                                                        "set model.cpu_offloading=false, or drop model_state_offload")
        if ms.model_state_offload == "disk" and getattr(model, "fp16", False):
            raise _field_error("fp16", True, "model_state_offload='disk' steps float32 or bf16 parameters unit by "
                                             "unit; fp16's loss scaling checks every gradient at once: set "
                                             "model.fp16=false (bf16 or float32), or use model_state_offload='host'")
    if longctx.memory.recompute_enabled and not recompute_moved and getattr(model, "recompute_granularity", None):
        raise _field_error("recompute_granularity", model.recompute_granularity,
                           f"Megatron's recompute would run together with megatron-longctx's "
                           f"(recompute_granularity={longctx.memory.recompute_granularity!r}); set "
                           "model.recompute_granularity=null, or drop the recompute_* options")
    try:
        _check_kernel_backend(longctx.cp.backend)
    except ValueError as err:
        raise ValueError(f"{PREFIX}: {err}") from None


def check_model_state_training(cfg: Any, longctx: LongContextConfig) -> None:
    """The training settings of a ``ConfigContainer`` the model-state offload refuses, each named with its fix
    (the streamer reduces each layer's gradients itself, and gathers the weights the distributed optimizer
    updated after the step);
    for ``disk``, a float32 optimizer and a directory the files can be written to."""
    if longctx.model_states.model_state_offload == "disk":
        from megatron_longctx.megatron.features.model_states import check_disk_dir

        mixed = getattr(cfg, "mixed_precision", None)
        fp16 = ("fp16" in mixed if isinstance(mixed, str)
                else any(getattr(x, "fp16", False) for x in (mixed, getattr(cfg, "optimizer", None))))
        if fp16:
            raise ValueError(f"{PREFIX}: model_state_offload='disk' steps float32 or bf16 parameters unit by unit; "
                             "fp16's loss scaling checks every gradient at once: set optimizer.fp16=false (a bf16 "
                             "or float32 mixed_precision), or use model_state_offload='host'")
        try:
            check_disk_dir(longctx)
        except ValueError as err:
            raise ValueError(f"{PREFIX}: {err}") from None
    for section, name, fix in (("ddp", "overlap_grad_reduce", "false"),
                               ("ddp", "overlap_param_gather", "false"),
                               ("ddp", "average_in_collective", "false")):
        if getattr(getattr(cfg, section, None), name, False):
            raise ValueError(f"{PREFIX}: model_state_offload streams each layer's weights and reduces its gradients "
                             f"itself; {section}.{name}=True does not go with it: set {section}.{name}={fix}, or "
                             "drop model_state_offload")


@dataclasses.dataclass
class LongContextModelHook:
    """Pre-wrap hook: the built model holds our attention in every self-attention; the memory features
    go on it.  Returns the model list unchanged otherwise (Bridge's and megatron-core's hook contract)."""

    options: dict = dataclasses.field(default_factory=dict)

    def __call__(self, model: list) -> list:
        from megatron_longctx.megatron.plugin import LongContextPlugin

        cfg = LongContextConfig.from_flat(self.options)
        check_built_model(model)
        LongContextPlugin(cfg).install_and_report(model, who=PREFIX)
        return model


def check_built_model(model: list) -> int:
    """The number of self-attention layers of ``model`` (a list of chunks); ``RuntimeError`` when any of
    them does not run megatron-longctx's attention (the spec was replaced or edited after configure)."""
    from megatron.core.transformer.attention import SelfAttention

    from megatron_longctx.megatron.core_attention import ContextParallelAttention

    attentions = [m for chunk in model for m in chunk.modules() if isinstance(m, SelfAttention)]
    foreign = sorted({type(a.core_attention).__name__ for a in attentions
                      if not isinstance(a.core_attention, ContextParallelAttention)})
    if foreign:
        raise RuntimeError(f"{PREFIX}: the built model runs {', '.join(foreign)} as core_attention, not "
                           "megatron-longctx's ContextParallelAttention: model.transformer_layer_spec was replaced "
                           "or edited after megatron_longctx.bridge.configure (or model.attention_backend is "
                           "local); call configure last")
    return len(attentions)


def _register_pre_wrap_hook(model: Any, hook: LongContextModelHook) -> None:
    """Register ``hook`` once (a second configure replaces the first one's) on either kind of model config."""
    if isinstance(getattr(model, "pre_wrap_hooks", None), list):  # megatron-core ModelConfig
        hooks = model.pre_wrap_hooks
    else:  # Bridge's ModelProviderMixin (register_pre_wrap_hook keeps them in _pre_wrap_hooks)
        if not hasattr(model, "_pre_wrap_hooks"):
            model._pre_wrap_hooks = []
        hooks = model._pre_wrap_hooks
    hooks[:] = [h for h in hooks if not isinstance(h, LongContextModelHook)]
    hooks.append(hook)
