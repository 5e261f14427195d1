"""``megatron_longctx.offload``: activation offloading (see :mod:`megatron_longctx.memory.offload`)."""

from megatron_longctx.memory.offload import ActivationOffloader, OffloadStats

__all__ = ["ActivationOffloader", "OffloadStats"]
