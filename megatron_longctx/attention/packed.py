"""Packed documents (THD): the public names of the packed path, in one place.

Megatron packs documents of different lengths into one sequence (``qkv_format="thd"``,
``PackedSeqParams`` with global ``cu_seqlens_q/kv`` and ``cu_seqlens_q/kv_padded``).  Under context
parallelism every document's padded slot is split into ``2*cp`` chunks and rank ``r`` keeps chunks
``r`` and ``2cp-1-r`` (:mod:`.layout`, :mod:`.packed_sharding`).  :func:`cp_attention_packed` (or
``cp_attention(..., packing=)``) runs the same algorithms as dense sequences on that layout
(:mod:`.api`); attention never crosses a document boundary.
"""

from __future__ import annotations

from .api import cp_attention_packed
from .layout import Packing, SeqLayout, group_order, partition_index
from .packed_sharding import (
    PackedSeqFields,
    gather_packed_shards,
    pad_packed,
    packed_batch_on_this_cp_rank,
    packed_position_ids,
    packed_seq_fields,
    real_token_mask,
    shard_packed,
    unpad_packed,
    unshard_packed,
)
from .schedule import packed_pairs

__all__ = [
    "Packing",
    "PackedSeqFields",
    "SeqLayout",
    "cp_attention_packed",
    "gather_packed_shards",
    "group_order",
    "pad_packed",
    "packed_batch_on_this_cp_rank",
    "packed_pairs",
    "packed_position_ids",
    "packed_seq_fields",
    "partition_index",
    "real_token_mask",
    "shard_packed",
    "unpad_packed",
    "unshard_packed",
]
