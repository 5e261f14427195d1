"""The core attention's share of a layer replayed in sequence tiles (``--longctx-recompute-tiles``).

:class:`~megatron_longctx.megatron.core_attention.ContextParallelAttention` holds a
:class:`~megatron_longctx.memory.tiled_recompute.ReplayPort`; while a replay is handed in through it, each
call lands here: what a replay cannot serve is refused by flag, then the tile's K/V are stored, its queries
attended over the gathered K/V, or its K/V gradients handed back (:mod:`megatron_longctx.memory.tiled_recompute`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_longctx import cp_algorithms as algorithms
from megatron_longctx.attention.args import attention_args
from megatron_longctx.attention.tiled import TiledKV
from megatron_longctx.memory.tiled_recompute import Replay

FLAG = "--longctx-recompute-tiles"


def attend_tile(attention: Any, replay: Replay, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                causal: bool, dense_mask: Optional[torch.Tensor], dropout_p: float, packed: bool) -> torch.Tensor:
    """``attention``'s output ``[t, b, np*hn_v]`` for the replay's tile (``query`` ``[t, b, np, hn]``)."""
    if packed:
        raise ValueError(f"{FLAG}: packed sequences (THD) are not replayed in tiles; set {FLAG} 0")
    if attention.softmax_offset is not None:
        raise ValueError(f"{FLAG}: attention sinks (--softmax-type {attention.softmax_type}) are not replayed in "
                         f"tiles; set {FLAG} 0 or --softmax-type vanilla")
    if dropout_p > 0:
        raise ValueError(f"{FLAG}: attention dropout ({dropout_p}) would draw other masks per tile; "
                         "set --attention-dropout 0")
    if dense_mask is not None:
        raise ValueError(f"{FLAG}: an arbitrary attention_mask is not replayed in tiles; use causal masking "
                         "(--no-create-attention-mask-in-dataloader)")
    settings, cp_size = attention.settings, attention.cp_size
    if cp_size > 1 and not algorithms.get(settings.algorithm).gathers_kv:
        raise ValueError(f"{FLAG}: a layer replayed in tiles gathers K/V once over the CP group (all-gather "
                         f"attention), but this layer runs {settings.algorithm!r}; set --longctx-cp-algorithm "
                         "allgather (or --cp-comm-type all_gather)")

    def make() -> TiledKV:
        args = attention_args(query, causal, settings.softmax_scale, settings.window_size, settings.backend)
        return TiledKV(attention.cp_group if cp_size > 1 else None, replay.seq_len, args)

    replay.state_for(make)
    out = replay.step(query, key, value)  # [t, b, np, hn_v]
    return out.reshape(out.shape[0], out.shape[1], -1)
