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
   pre-hooks run before any recompute wrapper re-enters the layer.  Under Megatron's training loop it
   waits for the optimizer (``waits_for_optimizer``): DDP wraps the model after the provider returns it.
"""

from __future__ import annotations

from megatron_longctx.megatron.features.base import Built, Feature, Installed
from megatron_longctx.megatron.features.lean_norm import LeanNormFeature
from megatron_longctx.megatron.features.model_states import FEATURE as MODEL_STATES
from megatron_longctx.megatron.features.offload import OffloadFeature
from megatron_longctx.megatron.features.recompute import RecomputeFeature
from megatron_longctx.megatron.features.tiled_loss import TiledLossFeature
from megatron_longctx.megatron.features.tiled_mlp import TiledMLPFeature


FEATURES: tuple[Feature, ...] = (
    TiledMLPFeature(),
    TiledLossFeature(),
    LeanNormFeature(),
    RecomputeFeature(),
    OffloadFeature(),
    MODEL_STATES,  # last: see 4. above
)

__all__ = ["FEATURES", "Built", "Feature", "Installed"]
