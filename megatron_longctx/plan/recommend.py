"""The planner's answer: the fastest configuration that fits (the search of :mod:`.search`), or, when none
does, :class:`~megatron_longctx.plan.search.PlanInfeasible` saying what dominates and the smallest change that
fits (:mod:`.advice`).
"""

from __future__ import annotations

from typing import Optional

from .advice import infeasible_message
from .efficiency import Efficiencies
from .model import ModelShape
from .search import Constraints, Plan, PlanInfeasible, all_plans, evaluate, fastest_fitting, tile_choices
from .timing import Hardware

__all__ = ["Constraints", "Plan", "PlanInfeasible", "all_plans", "evaluate", "recommend", "tile_choices"]


def recommend(m: ModelShape, seq_length: int, num_gpus: int, hw: Hardware, constraints: Constraints = Constraints(),
              micro_batch: int = 1, eff: Optional[Efficiencies] = None, advise: bool = True) -> Plan:
    """The fastest configuration that fits; :class:`PlanInfeasible` (saying what would fit, unless not
    ``advise``) when none does."""
    plan, plans = fastest_fitting(m, seq_length, num_gpus, hw, constraints, micro_batch, eff)
    if plan is not None:
        return plan
    if not advise:
        raise PlanInfeasible(f"no configuration fits {num_gpus} x {hw.name}")
    raise PlanInfeasible(infeasible_message(m, seq_length, num_gpus, hw, constraints, micro_batch, eff, plans))
