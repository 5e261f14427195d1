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

from ..lazy import attributes

_MODULES = {  # module -> the public names it holds
    ".api": ("ALGORITHMS", "cp_attention", "cp_attention_packed", "schedule_flops"),
    ".layout": ("Packing", "SeqLayout"),
    ".packed_sharding": ("packed_batch_on_this_cp_rank", "pad_packed", "shard_packed", "unpad_packed",
                         "unshard_packed"),
    ".sharding": ("shard_sequence", "unshard_sequence"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}

__all__ = sorted(_LAZY)


__getattr__ = attributes(__name__, _LAZY)
