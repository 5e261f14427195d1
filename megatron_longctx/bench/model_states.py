"""Model-state offload (``--longctx-model-state-offload``) on the benchmark's Trainer.

The Trainer runs its own loop on Megatron's DDP and ``get_megatron_optimizer``, so the plugin's installer
goes on where Megatron's training loop would put it (:meth:`ModelStatesFeature.defer` patches
``get_megatron_optimizer`` for that): over the DDP-wrapped model, then its optimizer hooks over the optimizer.
"""

from __future__ import annotations

from typing import Any

import torch


class ModelStates:
    """Model-state offload on the benchmark's model: :class:`~megatron_longctx.megatron.features.model_states.ModelStatesFeature`
    installed over Megatron's DDP as the training loop's ``get_megatron_optimizer`` would
    (:meth:`ModelStatesFeature.defer`), then its optimizer hooks on the optimizer built over it (``disk``:
    Adam's moments on disk, the step and the gradient clipping unit by unit)."""

    def __init__(self, installed: Any, cfg: Any) -> None:
        self.installed, self.cfg = installed, cfg
        self.target = cfg.model_states.model_state_offload

    @classmethod
    def install(cls, ddp: Any, cfg: Any) -> "ModelStates":
        from megatron_longctx.megatron.features.base import Built
        from megatron_longctx.megatron.features.model_states import ModelStatesFeature

        if cfg.model_states.model_state_offload == "host" and not torch.cuda.is_available():
            raise ValueError("--longctx-model-state-offload host keeps the model states in host memory, which on "
                             "a CPU-only process is the memory it trains in (nothing is saved): use "
                             "--longctx-model-state-offload disk on the CPU")
        return cls(ModelStatesFeature().install(Built.of([ddp]), cfg), cfg)

    @property
    def streamer(self) -> Any:
        return self.installed.streamer

    def wire_optimizer(self, optimizer: Any) -> None:
        from megatron_longctx.megatron.features.model_states import _optimizer_hooks

        _optimizer_hooks(self.installed, self.streamer, self.cfg)(optimizer)

    def close(self) -> None:
        from megatron_longctx.megatron.features.model_states import _close

        _close(self.installed)

    def describe(self, optimizer: Any) -> dict[str, Any]:
        """Where the states went and what streamed them: the point's record carries it."""
        from megatron_longctx.megatron.offdevice_optimizer import megatron_optimizers

        return {"target": self.target, "description": self.installed.description,
                "inner_optimizers": sorted({type(w.optimizer).__name__ for w in megatron_optimizers(optimizer)}),
                **self.installed.stats()}
