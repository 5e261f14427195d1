"""Context-parallel attention over Megatron's load-balanced sequence shards (no Megatron import).

:func:`cp_attention` is the entry point; :func:`shard_sequence` / :func:`unshard_sequence` produce and
undo the layout it expects; :func:`schedule_flops` prices the schedule each algorithm runs.  Packed
documents (THD): :class:`Packing` describes them, :func:`cp_attention_packed` (or ``cp_attention(...,
packing=)``) attends within each document, :func:`shard_packed` / :func:`unshard_packed` /
:func:`packed_batch_on_this_cp_rank` produce and undo the per-document layout.

Modules, bottom up: :mod:`.algorithms` (the algorithms by name, a leaf without torch), :mod:`.zigzag`
(the chunk rule), :mod:`.args` (arguments and their checks), :mod:`.segments` (the geometry of block
calls), :mod:`.layout`, :mod:`.schedule`, :mod:`.block_loop` (runs a rank's calls, merges, sums
gradients), :mod:`.comm`; the patterns :mod:`.ring`, :mod:`.allgather`, :mod:`.ulysses` (Ulysses, hybrid)
with :mod:`.hybrid` (its groups); :mod:`.sinks`; :mod:`.agreement` (the cross-rank check); :mod:`.api`
(the entry points); :mod:`.sharding` / :mod:`.packed_sharding`; :mod:`.tiled` (a layer replayed in tiles).

The names below are imported on first use, so that ``megatron_longctx.attention.algorithms`` is read
without torch (the config and the planner do).
"""

from __future__ import annotations

import importlib

_LAZY = {
    "ALGORITHMS": ".api",
    "cp_attention": ".api",
    "cp_attention_packed": ".api",
    "schedule_flops": ".api",
    "Packing": ".layout",
    "SeqLayout": ".layout",
    "packed_batch_on_this_cp_rank": ".packed_sharding",
    "pad_packed": ".packed_sharding",
    "shard_packed": ".packed_sharding",
    "unpad_packed": ".packed_sharding",
    "unshard_packed": ".packed_sharding",
    "shard_sequence": ".sharding",
    "unshard_sequence": ".sharding",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
