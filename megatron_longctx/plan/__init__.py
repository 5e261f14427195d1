"""The planner behind ``megatron-longctx plan``: memory and time of a long-context run, and its flags.

* :mod:`.model` — per-GPU memory: weights, gradients, distributed-optimizer states, activations per
  saved tensor (Korthikanti et al. arXiv:2205.05198) under recompute / offload / tiling, attention
  workspace, logits;
* :mod:`.timing` — step time: matmul and attention FLOPs, TP / CP / DP / host traffic and overlap;
* :mod:`.presets` — Llama-3-8B/70B, Mixtral-8x7B, DeepSeek-V2-Lite; H100/H200/B200/A100;
* :mod:`.recommend` — the search over TP, CP, CP algorithm and memory features;
* :mod:`.flags` — Megatron-LM and ``--longctx-*`` flags of a plan; :mod:`.cli` — the command.
"""

from megatron_longctx.plan.model import MemoryOptions, ModelShape, Parallel, memory_breakdown
from megatron_longctx.plan.recommend import Constraints, Plan, PlanInfeasible, evaluate, recommend
from megatron_longctx.plan.timing import Hardware, step_time

__all__ = ["Constraints", "Hardware", "MemoryOptions", "ModelShape", "Parallel", "Plan", "PlanInfeasible",
           "evaluate", "memory_breakdown", "recommend", "step_time"]
