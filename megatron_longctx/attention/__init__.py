"""Context-parallel attention over Megatron's load-balanced sequence shards (no Megatron import).

:func:`cp_attention` is the entry point; :func:`shard_sequence` / :func:`unshard_sequence` produce and
undo the layout it expects; :func:`schedule_flops` prices the schedule each algorithm runs.
"""

from .api import ALGORITHMS, cp_attention, schedule_flops
from .sharding import shard_sequence, unshard_sequence

__all__ = ["ALGORITHMS", "cp_attention", "schedule_flops", "shard_sequence", "unshard_sequence"]
