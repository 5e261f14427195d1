"""The lean RMSNorm (``--longctx-lean-norm``): torch RMSNorms that keep less for their backward."""

from __future__ import annotations

from megatron_longctx.config import LongContextConfig
from megatron_longctx.megatron.features.base import Built, Feature, Installed
from megatron_longctx.memory.rmsnorm import install_lean_norms


class LeanNormFeature(Feature):
    name = "lean RMSNorm"

    def enabled(self, cfg: LongContextConfig) -> bool:
        return cfg.memory.lean_norm

    def install(self, built: Built, cfg: LongContextConfig) -> Installed:
        norms = install_lean_norms(built.chunks)
        return Installed(patches=list(norms),
                         description=f"{len(norms)} norms" if norms else "none (the model has no torch RMSNorm)")
