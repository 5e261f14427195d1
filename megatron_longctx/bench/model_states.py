"""Model-state offload (``--longctx-model-state-offload``) on the benchmark's Trainer.

The Trainer runs its own loop on Megatron's DDP and ``get_megatron_optimizer``, so the plugin object puts the
installer where Megatron's training loop would (over the DDP-wrapped model), then its optimizer hooks over
the optimizer.
"""

from __future__ import annotations

from typing import Any

import torch


class ModelStates:
    """Model-state offload on the benchmark's model, through the plugin object as every user path goes:
    :meth:`LongContextPlugin.install_after_wrap` over Megatron's DDP (where Megatron's training loop would
    put it), then :meth:`LongContextPlugin.wire_optimizer` over the optimizer built over it (``disk``: Adam's
    moments on disk, the step and the gradient clipping unit by unit)."""

    def __init__(self, plugin: Any, installation: Any) -> None:
        self.plugin, self.installation = plugin, installation
        self.target = plugin.cfg.model_states.model_state_offload

    @classmethod
    def install(cls, ddp: Any, plugin: Any) -> "ModelStates":
        """``plugin``: the Trainer's :class:`~megatron_longctx.megatron.plugin.LongContextPlugin`."""
        if plugin.cfg.model_states.model_state_offload == "host" and not torch.cuda.is_available():
            raise ValueError("--longctx-model-state-offload host keeps the model states in host memory, which on "
                             "a CPU-only process is the memory it trains in (nothing is saved): use "
                             "--longctx-model-state-offload disk on the CPU")
        return cls(plugin, plugin.install_after_wrap(ddp))

    @property
    def streamer(self) -> Any:
        return next(done.streamer for _, done in self.installation.installed if hasattr(done, "streamer"))

    def building_optimizer(self) -> Any:
        """The context Megatron's optimizer is built in over the streamed model."""
        return self.plugin.building_optimizer(self.installation)

    def wire_optimizer(self, optimizer: Any) -> None:
        self.plugin.wire_optimizer(self.installation, optimizer)

    def close(self) -> None:
        self.installation.remove()

    def describe(self, optimizer: Any) -> dict[str, Any]:
        """Where the states went and what streamed them: the point's record carries it."""
        from megatron_longctx.megatron.offdevice_optimizer import megatron_optimizers

        return {"target": self.target, "description": self.installation.describe(),
                "inner_optimizers": sorted({type(w.optimizer).__name__ for w in megatron_optimizers(optimizer)}),
                **self.installation.stats()}
