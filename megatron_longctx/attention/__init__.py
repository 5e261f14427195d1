"""Context-parallel attention over Megatron's load-balanced sequence shards (no Megatron import).

:func:`cp_attention` is the entry point; :func:`shard_sequence` / :func:`unshard_sequence` produce and
undo the layout it expects; :func:`schedule_flops` prices the schedule each algorithm runs.  Packed
documents (THD): :class:`Packing` describes them, :func:`cp_attention_packed` (or ``cp_attention(...,
packing=)``) attends within each document, :func:`shard_packed` / :func:`unshard_packed` /
:func:`packed_batch_on_this_cp_rank` produce and undo the per-document layout.  Dense and packed
sequences share one layout (:class:`SeqLayout`, a dense sequence is one document) and one schedule
builder (:mod:`.schedule`).

Modules, bottom up: :mod:`.zigzag` (the chunk rule), :mod:`.args` (arguments and their checks; the
algorithms themselves are :mod:`megatron_longctx.cp_algorithms`), :mod:`.segments` (the geometry of block
calls), :mod:`.layout`, :mod:`.schedule`, :mod:`.block_loop` (runs a rank's calls, merges, sums gradients),
:mod:`.comm`; :mod:`.pattern` (the autograd every pattern shares) and the patterns :mod:`.ring`,
:mod:`.allgather`, :mod:`.ulysses` (Ulysses, hybrid) with :mod:`.hybrid` (its groups); :mod:`.sinks`;
:mod:`.agreement` (the cross-rank check); :mod:`.api` (the entry points); :mod:`.sharding` /
:mod:`.packed_sharding`; :mod:`.tiled` (a layer replayed in tiles); :mod:`.packed` (packed names).
"""

from .api import ALGORITHMS, cp_attention, cp_attention_packed, schedule_flops
from .layout import Packing, SeqLayout
from .packed_sharding import (
    packed_batch_on_this_cp_rank,
    pad_packed,
    shard_packed,
    unpad_packed,
    unshard_packed,
)
from .sharding import shard_sequence, unshard_sequence

__all__ = [
    "ALGORITHMS",
    "Packing",
    "SeqLayout",
    "cp_attention",
    "cp_attention_packed",
    "packed_batch_on_this_cp_rank",
    "pad_packed",
    "schedule_flops",
    "shard_packed",
    "shard_sequence",
    "unpad_packed",
    "unshard_packed",
    "unshard_sequence",
]
