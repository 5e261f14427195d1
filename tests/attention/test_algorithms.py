"""The algorithm registry: every consumer reads an algorithm's properties, and the names stay in one place."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_longctx import cp_algorithms as algorithms
from megatron_longctx.attention import schedule_flops
from megatron_longctx.plan.search import CP_COMM_TYPES


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, (40, 0))])
def test_every_algorithm_scores_each_visible_pair_once_over_the_group(causal, window):
    """Summed over the ranks (each rank's heads being 1/divisor of the model's), every algorithm scores the
    sequence's visible pairs exactly once: the registry's head split is what the schedule divides by."""
    flops = {a.name: schedule_flops(a.name, 4, 256, causal=causal, window_size=window, heads=8, d_qk=8,
                                    ulysses_size=2 if a.heads == "groups" else None)
             for a in algorithms.REGISTRY.values()}
    totals = {name: sum(per_rank) for name, per_rank in flops.items()}
    assert len(set(totals.values())) == 1, totals
    visible = (256 * 257 // 2 if causal and window is None else
               256 * 256 if not causal else sum(min(i, 40) + 1 for i in range(256)))
    assert totals["ring"] == 2 * (8 + 8) * 8 * visible


def test_megatron_comm_types_map_to_the_registry():
    assert set(CP_COMM_TYPES) <= set(algorithms.BY_CP_COMM_TYPE)  # every layout the planner prints is served
    for a in algorithms.REGISTRY.values():
        assert algorithms.for_cp_comm_type(a.cp_comm_type) is a
    assert algorithms.for_cp_comm_type("all_gather").gathers_kv
    with pytest.raises(ValueError, match=r"--cp-comm-type 'ring' \(layer 3\) is not supported; choose one of "
                                         r"a2a, a2a\+p2p, all_gather, allgather, p2p, or set --longctx-cp-algorithm"):
        algorithms.for_cp_comm_type("ring", " (layer 3)")
    with pytest.raises(ValueError, match=r"algorithm='zigzag' is not one of \('ring', 'allgather', 'ulysses', "
                                         r"'hybrid'\) \(Megatron's --cp-comm-type p2p / all_gather / a2a / a2a\+p2p"):
        algorithms.get("zigzag")


@pytest.mark.parametrize("name, cp, ulysses, degree", [("ring", 4, None, 1), ("allgather", 4, None, 1),
                                                       ("ulysses", 4, None, 4), ("hybrid", 4, 2, 2)])
def test_ulysses_degree(name, cp, ulysses, degree):
    assert algorithms.get(name).ulysses_degree(cp, ulysses) == degree


def test_the_registry_is_read_without_torch():
    """The config and the planner take the names from the registry and stay importable without torch."""
    code = ("import sys, megatron_longctx.config, megatron_longctx.plan.flags; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]")
    subprocess.run([sys.executable, "-c", code], check=True)
