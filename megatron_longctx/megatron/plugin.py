"""The plugin object: the one way megatron-longctx goes into a Megatron model.

:class:`LongContextPlugin` is built from the typed config.  ``spec()`` puts ContextParallelAttention into
a spec and applies each enabled feature's spec edit; ``model_config()`` adjusts Megatron's model config
(its recompute off where the plugin runs it); ``check()`` runs every enabled feature's checks;
``install()`` puts the enabled features (:data:`.features.FEATURES`, in that order) on a built model and
returns the :class:`Installation`.  The launcher, the main job, the Megatron-Bridge hook and the
benchmark engine all build through it (:func:`build_model`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Optional

from megatron_longctx.config import LongContextConfig
from megatron_longctx.megatron.features import FEATURES, Built, Feature, Installed
from megatron_longctx.megatron.spec_walk import walk_spec


class Installation:
    """What :meth:`LongContextPlugin.install` put on a model; ``remove()`` takes it all off again."""

    def __init__(self, built: Built, installed: list[tuple[Feature, Installed]]):
        self.built = built
        self.installed = installed
        self.layers = built.layers
        self.offloader = built.shared.get("offloader")

    @property
    def patches(self) -> list[Callable[[], None]]:
        """Every undo callable, in the order the patches were made."""
        return [undo for _, done in self.installed for undo in done.patches]

    def describe(self) -> str:
        """One line: each feature put on the model and where (e.g. ``tiled MLP: 4 tiles on 2 MLPs``)."""
        parts = [f"{done.name or feature.name}: {done.description}" for feature, done in self.installed
                 if done.description is not None]
        return "; ".join(parts) or "none"

    def stats(self) -> dict[str, int]:
        """The features' counters so far (the offloader's bytes; ``{}`` where none keeps any)."""
        out: dict[str, int] = {}
        for _, done in self.installed:
            if done.stats is not None:
                out.update(done.stats())
        return out

    def remove(self) -> None:
        """Undo every patch, last first, then close what the features opened."""
        while self.installed:
            _, done = self.installed.pop()
            while done.patches:
                done.patches.pop()()
            if done.close is not None:
                done.close()


class LongContextPlugin:
    """megatron-longctx for one configuration (``cfg``)."""

    def __init__(self, cfg: LongContextConfig, features: tuple[Feature, ...] = FEATURES):
        if not isinstance(cfg, LongContextConfig):
            raise TypeError(f"LongContextPlugin: cfg must be a LongContextConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.features = tuple(f for f in features if f.enabled(cfg))

    def spec(self, spec: Any, require: bool = True) -> Any:
        """A copy of ``spec`` with ContextParallelAttention in every self-attention ``core_attention``, then
        each enabled feature's spec edit.  ``require=False`` passes a spec without attention through."""
        from megatron_longctx.megatron.attention_spec import core_attention_spec, self_attention_rule

        out, replaced = walk_spec(spec, self_attention_rule(core_attention_spec(self.cfg.cp)))
        if replaced == 0 and require:
            raise ValueError(f"apply_to_spec found no self-attention core_attention in {type(spec).__name__}; pass a "
                             "Megatron layer spec (e.g. get_gpt_layer_local_spec()), block spec or stack spec")
        return self.memory_spec(out)

    def memory_spec(self, spec: Any) -> Any:
        """Only the enabled features' spec edits (no attention replaced)."""
        for feature in self.features:
            spec = feature.spec(spec, self.cfg)
        return spec

    def model_config(self, config: Any) -> Any:
        """``config`` (a TransformerConfig) as the model is built with it: the one place Megatron's own
        recompute is turned off where the plugin runs it."""
        for feature in self.features:
            config = feature.model_config(config, self.cfg)
        return config

    def check(self, config: Any) -> None:
        """Every enabled feature's checks against the model's config (``ValueError`` naming flag and fix)."""
        if config is None:
            return
        for feature in self.features:
            feature.check(self.cfg, config)

    def install(self, model: Any, features: Optional[tuple[Feature, ...]] = None) -> Installation:
        """Put the enabled features (or ``features`` of them) on a built ``model`` (a module, possibly
        DDP/Float16Module-wrapped, or a list of chunks) in the order of :data:`FEATURES`."""
        built = Built.of(model)
        self.check(built.config)
        installation = Installation(built, [])
        try:
            for feature in self.features if features is None else features:
                installation.installed.append((feature, feature.install(built, self.cfg)))
        except BaseException:
            installation.remove()
            raise
        installation.offloader = built.shared.get("offloader")
        return installation

    def install_after_wrap(self, model: Any) -> Installation:
        """For a caller that wraps the model in DDP and builds its optimizer itself (the benchmark engine): the
        features that wait for the optimizer (:attr:`Feature.waits_for_optimizer`), on the DDP-wrapped
        ``model``; then :meth:`wire_optimizer` with the optimizer built over it."""
        return self.install(model, tuple(f for f in self.features if f.waits_for_optimizer))

    def wrapping_ddp(self, model: Any) -> contextlib.AbstractContextManager:
        """The context to wrap ``model`` in Megatron's DDP in, before :meth:`install_after_wrap`."""
        stack = contextlib.ExitStack()
        for feature in self.features:
            if feature.waits_for_optimizer:
                stack.enter_context(feature.wrapping_ddp(model, self.cfg))
        return stack

    def building_optimizer(self, installation: Installation) -> contextlib.AbstractContextManager:
        """The context to build Megatron's optimizer in over the model ``installation`` went on."""
        stack = contextlib.ExitStack()
        for feature, done in installation.installed:
            stack.enter_context(feature.building_optimizer(done))
        return stack

    def wire_optimizer(self, installation: Installation, optimizer: Any) -> Any:
        """``optimizer`` (built over the model ``installation`` went on) with its features' hooks."""
        for feature, done in installation.installed:
            optimizer = feature.wire_optimizer(done, optimizer, self.cfg)
        return optimizer

    def install_and_report(self, model: Any, who: str = "megatron-longctx") -> Optional[Installation]:
        """Under Megatron's training loop, on the model its provider returns: :meth:`install` the features
        that go on now (``None`` where there are none); each chunk of ``model`` then holds the installation
        as ``_longctx_memory_handle``.  A feature that ``waits_for_optimizer`` is deferred to the optimizer's
        build.  Rank 0 prints one line naming each feature and where it went (once all are in)."""
        mem = self.cfg.memory
        now = tuple(f for f in self.features if not f.waits_for_optimizer)
        later = [f for f in self.features if f.waits_for_optimizer]
        installation = self.install(model, now) if now else None
        if installation is not None:
            for chunk in model if isinstance(model, list) else [model]:
                chunk._longctx_memory_handle = installation
        rank0 = os.environ.get("RANK", "0") == "0"
        if rank0 and installation is not None and mem.recompute_enabled:
            what = (f"selective: {' '.join(mem.recompute_modules)}" if mem.recompute_granularity == "selective"
                    else f"full: {mem.recompute_method}")
            print(f"{who}: Megatron's --recompute-granularity ({what}) runs in the plugin's recompute on "
                  f"{len(installation.layers)} layers (see plugin_recompute)", flush=True)
        line = installation.describe() if installation is not None else None
        for feature in later:
            feature.defer(model, self.cfg, who, line)
        if rank0 and installation is not None and not later:
            print(f"{who}: memory features: {line}", flush=True)
        return installation

    def build(self, build: Callable[[Any, dict[str, Any]], Any], config: Any, specs: dict[str, Any],
              who: str = "megatron-longctx") -> Any:
        """Build a model with the plugin in it: every spec through :meth:`spec` (``None`` passed through),
        ``build(model_config(config), specs)``, then :meth:`install_and_report` on what it returns."""
        specs = {name: None if spec is None else self.spec(spec, require=False) for name, spec in specs.items()}
        model = build(self.model_config(config), specs)
        self.install_and_report(model, who)
        return model
