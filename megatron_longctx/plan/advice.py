"""What to say when nothing fits: the dominant term, and the smallest change that would fit.

Changes are tried from the cheapest for the user to the most expensive: turning off Megatron's dense
dataloader mask; dropping the choices fixed on the command line; more host memory (when only the host
is short); model-state offload (``--longctx-model-state-offload``, ``docs/model-state-offload.md``);
more GPUs (the smallest multiple that fits); a shorter sequence (the longest that fits).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .efficiency import Efficiencies
from .model import GIB, ModelShape
from .search import (
    HOST_MARGIN, MEMORY_MARGIN, Constraints, Plan, PlanInfeasible, _SEARCHED, closest, describe, fastest_fitting,
)
from .timing import Hardware

SEQ_GRANULE = 8192  # the longest-sequence search works in steps of this many tokens
MAX_GPU_FACTOR = 64


def _try(m: ModelShape, s: int, n: int, hw: Hardware, c: Constraints, mb: int,
         eff: Optional[Efficiencies]) -> Optional[Plan]:
    try:
        return fastest_fitting(m, s, n, hw, c, mb, eff)[0]
    except PlanInfeasible:
        return None


def longest_sequence(m: ModelShape, num_gpus: int, hw: Hardware, c: Constraints = Constraints(),
                     micro_batch: int = 1, eff: Optional[Efficiencies] = None,
                     limit: int = 1 << 25) -> Optional[Plan]:
    """The plan of the longest sequence (a multiple of 8K tokens × 2·GPUs) that fits, or None."""
    granule = SEQ_GRANULE * 2 * num_gpus if num_gpus > 1 else SEQ_GRANULE
    lo, hi, best = 0, limit // granule, None  # invariant: lo fits (or is 0), hi + 1 does not
    probe = 1
    while probe <= hi:  # grow until the first miss, then bisect
        plan = _try(m, probe * granule, num_gpus, hw, c, micro_batch, eff)
        if plan is None:
            hi = probe - 1
            break
        lo, best, probe = probe, plan, probe * 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        plan = _try(m, mid * granule, num_gpus, hw, c, micro_batch, eff)
        if plan is None:
            hi = mid - 1
        else:
            lo, best = mid, plan
    return best


def infeasible_message(m: ModelShape, s: int, num_gpus: int, hw: Hardware, c: Constraints, mb: int,
                       eff: Optional[Efficiencies], plans: list[Plan]) -> str:
    near = closest(plans)
    mem = near.memory
    name, size = mem.dominant()
    gpu_fitting = [p for p in plans if p.memory.peak <= p.usable_bytes]  # short of host memory only
    host_need = min(gpu_fitting, key=lambda p: p.memory.host_offload) if gpu_fitting else None
    lines = [f"no configuration of {m.name} at --seq-length {s} fits {num_gpus} x {hw.name} ({hw.memory_gib:.0f} GiB, "
             f"{MEMORY_MARGIN:.0%} usable; host {hw.host_bytes_per_gpu(num_gpus) / GIB:.0f} GiB per GPU"
             + (f"; fixed: {_fixed_text(c)}" if c.fixed() else "") + ").",
             f"Closest: {describe(near)} needs {mem.peak / GIB:.1f} GiB per GPU and "
             f"{mem.host_offload / GIB:.0f} GiB of host memory per GPU; the largest part is {name} "
             f"({size / GIB:.1f} GiB)" + _states_note(near) + "."]
    lines.append("Smallest change that fits: " + _smallest_change(m, s, num_gpus, hw, c, mb, eff, near, host_need))
    return "\n".join(lines)


def _states_note(p: Plan) -> str:
    states = p.memory.weights + p.memory.grads
    if states > 0.25 * p.usable_bytes and not p.options.model_state_offload:
        return (f"; bf16 weights + main grads take {states / GIB:.1f} GiB, which Megatron keeps on the GPU "
                "(it has no parameter or gradient offload)")
    return ""


def _fixed_text(c: Constraints) -> str:
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in c.fixed().items())


def _smallest_change(m: ModelShape, s: int, n: int, hw: Hardware, c: Constraints, mb: int,
                     eff: Optional[Efficiencies], near: Plan, host_need: Optional[Plan]) -> str:
    if c.dataloader_mask:
        plan = _try(m, s, n, hw, dataclasses.replace(c, dataloader_mask=False), mb, eff)
        if plan:
            return (f"add --no-create-attention-mask-in-dataloader (Megatron's dense mask is "
                    f"{near.memory.dataloader_mask / GIB:.0f} GiB per GPU; this package's attention ignores it): "
                    f"{describe(plan)}, {plan.memory.peak / GIB:.1f} GiB.")
    if c.fixed():
        free = dataclasses.replace(c, **{k: None for k in _SEARCHED})
        plan = _try(m, s, n, hw, free, mb, eff)
        if plan:
            return f"drop the fixed choices ({_fixed_text(c)}): {describe(plan)}, {plan.memory.peak / GIB:.1f} GiB."
    if host_need is not None:
        per_node = min(n, hw.gpus_per_node)
        need = host_need.memory.host_offload / HOST_MARGIN * per_node / GIB
        return (f"more host memory: --host-memory-gib {need:.0f} (per node, shared by the job's {per_node} GPU(s) "
                f"on it; now {hw.host_memory_gib:.0f}) for {describe(host_need)}, "
                f"{host_need.memory.peak / GIB:.1f} GiB per GPU.")
    if not c.model_state_offload:
        plan = _try(m, s, n, hw, dataclasses.replace(c, model_state_offload="host", optimizer_offload=None), mb, eff)
        if plan:
            return (f"model-state offload (--longctx-model-state-offload host: bf16 weights streamed per layer from "
                    f"host memory, grads accumulated there, AdamW on the CPU; docs/model-state-offload.md): "
                    f"{describe(plan)}, {plan.memory.peak / GIB:.1f} GiB and {plan.memory.host_offload / GIB:.0f} GiB "
                    f"of host memory per GPU.")
    factor = 2
    while factor <= MAX_GPU_FACTOR:
        plan = _try(m, s, n * factor, hw, c, mb, eff)
        if plan:
            return f"--num-gpus {n * factor}: {describe(plan)}, {plan.memory.peak / GIB:.1f} GiB."
        factor *= 2
    best = longest_sequence(m, n, hw, c, mb, eff, limit=s)
    if best:
        return f"--seq-length {best.seq_length} (the longest that fits): {describe(best)}."
    return "none found: use GPUs with more memory (--gpu-memory-gib)."
