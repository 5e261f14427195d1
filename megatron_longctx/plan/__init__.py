"""The planner behind ``megatron-longctx plan``: memory and time of a long-context run, and its flags.

* :mod:`.model` — model shape, memory options, activations per saved tensor (Korthikanti et al.
  arXiv:2205.05198) under recompute / offload / tiling;
* :mod:`.states` — weights, main grads, optimizer states (distributed optimizer, FSDP, CPU offload,
  FP8 caches, model-state offload); :mod:`.memory` — the peak per GPU and pipeline stage;
* :mod:`.timing` — step time: matmul and attention FLOPs, TP / CP / PP / DP / host traffic and overlap;
* :mod:`.efficiency` — achieved shares of peak per GPU and kernel backend, and ``--calibrate``;
* :mod:`.flops` — model FLOPs in Megatron's and NeMo's conventions (TFLOP/s, MFU);
* :mod:`.presets` — Llama-2-7B, Llama-3-8B/70B, Mixtral-8x7B, DeepSeek-V2-Lite; H100/H200/B200/A100;
* :mod:`.search` — the search; :mod:`.advice` — what to change when nothing fits; :mod:`.recommend` — both;
* :mod:`.flags` — Megatron-LM and ``--longctx-*`` flags of a plan; :mod:`.cli` — the command;
  :mod:`.recipes` — the planner's header of the recipes in ``examples/``.
"""

from megatron_longctx.plan.memory import MemoryBreakdown, memory_breakdown
from megatron_longctx.plan.model import MemoryOptions, ModelShape, Parallel
from megatron_longctx.plan.recommend import recommend
from megatron_longctx.plan.search import Constraints, Plan, PlanInfeasible, evaluate
from megatron_longctx.plan.timing import Hardware, step_time

__all__ = ["Constraints", "Hardware", "MemoryBreakdown", "MemoryOptions", "ModelShape", "Parallel", "Plan",
           "PlanInfeasible", "evaluate", "memory_breakdown", "recommend", "step_time"]
