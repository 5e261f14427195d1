"""The tiled MLP: the spec builds :class:`TiledMLP`; on a built model, MLPs the spec did not tile are tiled."""

from __future__ import annotations

from typing import Any

from megatron_longctx.config import LongContextConfig
from megatron_longctx.megatron.features.base import Built, Feature, Installed
from megatron_longctx.megatron.spec_walk import KEEP, built_class, walk_spec
from megatron_longctx.megatron.tiled_mlp import tile_mlp_forward, tiled_mlp_spec, tiled_mlp_type

_UNTILED_MLPS = ("IdentityOp", "MoELayer")


def tile_spec(spec: Any, num_tiles: int) -> Any:
    def rule(submodules: Any, name: str, entry: Any) -> Any:
        # a layer's mlp; an attention-only layer has none (IdentityOp), MoE layers route over the whole sequence
        if name != "mlp" or getattr(built_class(entry), "__name__", "") in _UNTILED_MLPS:
            return KEEP
        return tiled_mlp_spec(entry, num_tiles)

    out, tiled = walk_spec(spec, rule)
    if tiled == 0:
        raise ValueError(f"--longctx-tiled-mlp-tiles: no TransformerLayer spec with a dense mlp in "
                         f"{type(spec).__name__}; pass a layer spec (e.g. get_gpt_layer_local_spec()) or set the "
                         "option to 0")
    return out


class TiledMLPFeature(Feature):
    name = "tiled MLP"

    def enabled(self, cfg: LongContextConfig) -> bool:
        return cfg.memory.tiled_mlp_tiles > 1

    def spec(self, spec: Any, cfg: LongContextConfig) -> Any:
        return tile_spec(spec, cfg.memory.tiled_mlp_tiles)

    def install(self, built: Built, cfg: LongContextConfig) -> Installed:
        tiles = cfg.memory.tiled_mlp_tiles
        tiled = tiled_mlp_type()
        mlps = [getattr(layer, "mlp", None) for layer in built.layers]
        dense = [m for m in mlps if type(m).__name__ in ("MLP", "TEFusedMLP") and not isinstance(m, tiled)]
        if built.layers and not dense and not any(isinstance(m, tiled) for m in mlps):
            raise ValueError("--longctx-tiled-mlp-tiles: the model has no dense MLP to tile (MoE layers are not "
                             "tiled); set it to 0")
        return Installed(patches=[tile_mlp_forward(mlp, tiles) for mlp in dense],
                         description=f"{tiles} tiles on {sum(m is not None for m in mlps)} MLPs")
