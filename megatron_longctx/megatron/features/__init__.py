"""One installer per memory feature (:mod:`.base` states the contract).

``FEATURES`` is the order in which the plugin installs them on a built model; each wraps what the ones
before it left, so a later installer is the outer wrapper:

1. tiled MLP, tiled loss, lean RMSNorm: they replace what a module computes (its forward), so they go
   first, under every wrapper that decides what the module saves;
2. recompute: selective recompute wraps named submodules around what (1) computes, and the one wrapper per
   layer (layer scope, offload packing, full recompute) goes on each layer;
3. offload: scopes around the named submodules, outside selective recompute, so they see what a recomputed
   module keeps (the offloader itself is shared, made on first use: :func:`.offload.offloader_of`);
4. model-state offload, last (outermost): it must see every other wrapper in place, and its layer
   pre-hooks run before any recompute wrapper re-enters the layer.
"""

from __future__ import annotations

import importlib

from megatron_longctx.megatron.features.base import Built, Feature, Installed
from megatron_longctx.megatron.features.lean_norm import LeanNormFeature
from megatron_longctx.megatron.features.offload import OffloadFeature
from megatron_longctx.megatron.features.recompute import RecomputeFeature
from megatron_longctx.megatron.features.tiled_loss import TiledLossFeature
from megatron_longctx.megatron.features.tiled_mlp import TiledMLPFeature


def _model_states() -> tuple[Feature, ...]:
    """The model-state offload installer where its module is present (it is optional in this tree)."""
    name = "megatron_longctx.megatron.features.model_states"
    try:
        model_states = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise
        return ()
    return (model_states.FEATURE,)


FEATURES: tuple[Feature, ...] = (
    TiledMLPFeature(),
    TiledLossFeature(),
    LeanNormFeature(),
    RecomputeFeature(),
    OffloadFeature(),
    *_model_states(),  # last: see 4. above
)

__all__ = ["FEATURES", "Built", "Feature", "Installed"]
