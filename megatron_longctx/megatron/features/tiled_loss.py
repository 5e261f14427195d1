"""The tiled loss on the post-process stage (logits and cross-entropy in sequence tiles)."""

from __future__ import annotations

from megatron_longctx.config import LongContextConfig
from megatron_longctx.megatron.features.base import Built, Feature, Installed
from megatron_longctx.megatron.features.offload import residual_grad_target
from megatron_longctx.megatron.tiled_loss import install_tiled_loss


class TiledLossFeature(Feature):
    name = "tiled loss"

    def enabled(self, cfg: LongContextConfig) -> bool:
        return cfg.memory.tiled_loss_tiles > 1

    def install(self, built: Built, cfg: LongContextConfig) -> Installed:
        mem = cfg.memory
        grad_target = residual_grad_target(built, cfg)
        patches = [install_tiled_loss(chunk, mem.tiled_loss_tiles, mem.tiled_loss_recompute, grad_target)
                   for chunk in built.chunks
                   if getattr(chunk, "post_process", False) and hasattr(chunk, "compute_language_model_loss")]
        recompute = ", logits recomputed in backward" if mem.tiled_loss_recompute else ""
        return Installed(patches=patches, description=f"{mem.tiled_loss_tiles} tiles{recompute}" if patches else None)
