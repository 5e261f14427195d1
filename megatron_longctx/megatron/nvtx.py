"""Megatron's NVTX range stack as the tiled replay sees it."""

from __future__ import annotations


class NvtxRanges:
    """Megatron's NVTX range stack (``megatron.core.utils``, ``--nvtx-ranges``) as a
    :class:`tiled_recompute.RangeStack`: a tile replay stops inside ``TransformerLayer`` and ``Attention``
    ranges (:class:`tiled_recompute.ReplayStop`), which are popped here, innermost first."""

    def depth(self) -> int:
        from megatron.core import utils

        return len(getattr(utils, "_nvtx_range_messages", ()))

    def pop_to(self, depth: int) -> None:
        from megatron.core import utils

        while self.depth() > depth:
            utils.nvtx_range_pop(utils._nvtx_range_messages[-1])
