"""``megatron_longctx.recompute``: activation recompute (see :mod:`megatron_longctx.memory.recompute`)."""

from megatron_longctx.memory.recompute import (
    CheckpointFunction,
    DiscardOutputPacker,
    RngSnapshot,
    apply_selective_recompute,
    checkpoint,
)

__all__ = ["CheckpointFunction", "DiscardOutputPacker", "RngSnapshot", "apply_selective_recompute", "checkpoint"]
