"""The context-parallel algorithms by name: how each splits the heads and moves K/V (a leaf: it imports
nothing, so the config and the planner read it as the attention does).

Every other module reads an algorithm's properties here, never its name: the attention's entry point picks
the pattern, the schedule counts pairs, the group builder makes the all-to-all and ring groups, the Megatron
layer and the command line map ``--cp-comm-type`` and check the tiled replay, the planner prints the flag.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

# How an algorithm spreads the query heads over the CP group: "none" (each rank keeps every head),
# "all" (an all-to-all over the whole group: each rank gets 1/cp of them), "groups" (an all-to-all inside
# groups of ulysses_size ranks, a ring across the groups).
HeadSplit = Literal["none", "all", "groups"]


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str  # --longctx-cp-algorithm / cp_attention(algorithm=...)
    cp_comm_types: tuple[str, ...]  # Megatron's --cp-comm-type values it serves (the first is the canonical one)
    heads: HeadSplit
    gathers_kv: bool  # K/V gathered once over the CP group (what a layer replayed in tiles needs), not ringed
    summary: str

    @property
    def cp_comm_type(self) -> str:
        return self.cp_comm_types[0]

    def ulysses_degree(self, cp_size: int, ulysses_size: int | None) -> int:
        """Ranks per all-to-all group (1: no all-to-all)."""
        if self.heads == "all":
            return cp_size
        if self.heads == "groups":
            return ulysses_size or 1
        return 1


REGISTRY: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("ring", ("p2p",), "none", False, "Ring Attention over zigzag chunks, K/V passed rank to rank"),
    Algorithm("allgather", ("all_gather", "allgather"), "none", True, "K/V gathered once (Llama 3)"),
    Algorithm("ulysses", ("a2a",), "all", False, "DeepSpeed-Ulysses: an all-to-all trades sequence for heads"),
    Algorithm("hybrid", ("a2a+p2p",), "groups", False, "USP: Ulysses inside groups, a ring across them"),
)}
NAMES: tuple[str, ...] = tuple(REGISTRY)
BY_CP_COMM_TYPE: dict[str, Algorithm] = {c: a for a in REGISTRY.values() for c in a.cp_comm_types}


def get(name: str) -> Algorithm:
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"algorithm={name!r} is not one of {NAMES} (Megatron's --cp-comm-type "
                         f"{' / '.join(a.cp_comm_type for a in REGISTRY.values())} map to them in that order)") from None


def for_cp_comm_type(comm_type: str, where: str = "") -> Algorithm:
    """The algorithm serving Megatron's ``--cp-comm-type`` value; ``ValueError`` naming the flag."""
    try:
        return BY_CP_COMM_TYPE[comm_type]
    except (KeyError, TypeError):
        raise ValueError(f"--cp-comm-type {comm_type!r}{where} is not supported; choose one of "
                         f"{', '.join(sorted(BY_CP_COMM_TYPE))}, or set --longctx-cp-algorithm") from None
