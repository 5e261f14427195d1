"""Pick TP / CP size, CP algorithm, recompute, offload and tiling for a model, a sequence and a cluster.

Every candidate is scored with :mod:`.model` (peak memory per GPU, host bytes for offload) and
:mod:`.timing` (step time); among those that fit, the one with the most tokens per second per GPU
wins, except that a plan within 3% of it that leaves 10% of the usable memory free beats a tighter one.
Ties (tiling under full recompute costs no time) go to the fewest memory features, then the smaller peak.  Pipeline parallelism is not searched (PP = 1): at long context the
pipeline bubble of the few micro-batches per step costs more than CP's communication.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterator, Optional

from .model import GIB, MemoryBreakdown, MemoryOptions, ModelShape, Parallel, memory_breakdown
from .timing import Hardware, StepTime, step_time

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# (recompute, offload) from cheapest in time to cheapest in memory.
MEMORY_MODES = (("none", "none"), ("none", "layers"), ("full", "none"), ("full", "checkpoint"))
MLP_TILES = (1, 4, 16)
LOSS_TILES = (1, 8, 32)
MEMORY_MARGIN = 0.95  # share of the card the allocator can be expected to hand out
HOST_MARGIN = 0.9
THROUGHPUT_TOLERANCE = 0.03
COMFORT = 0.9  # a plan above this share of the usable memory is tight


class PlanInfeasible(ValueError):
    """No configuration fits; the message says what was closest and what to change."""


@dataclasses.dataclass(frozen=True)
class Constraints:
    """Choices the user fixed on the command line (None = search)."""

    tp: Optional[int] = None
    cp: Optional[int] = None
    cp_comm_type: Optional[str] = None
    recompute: Optional[str] = None
    offload: Optional[str] = None
    tiled_mlp_tiles: Optional[int] = None
    tiled_loss_tiles: Optional[int] = None
    optimizer_offload: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.cp_comm_type is not None and self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type {self.cp_comm_type!r}: choose one of {', '.join(CP_COMM_TYPES)}")
        if self.offload == "checkpoint" and self.recompute not in (None, "full"):
            raise ValueError("--offload checkpoint moves the layer inputs that full recompute keeps; "
                             "add --recompute full, or use --offload layers")
        for name in ("tp", "cp", "tiled_mlp_tiles", "tiled_loss_tiles"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value}: give an integer >= 1")


@dataclasses.dataclass(frozen=True)
class Plan:
    """One scored configuration."""

    model: ModelShape
    seq_length: int
    num_gpus: int
    hardware: Hardware
    parallel: Parallel
    options: MemoryOptions
    memory: MemoryBreakdown
    time: StepTime

    @property
    def usable_bytes(self) -> float:
        return self.hardware.memory_gib * GIB * MEMORY_MARGIN

    @property
    def host_usable_bytes(self) -> float:
        return self.hardware.host_memory_gib_per_gpu * GIB * HOST_MARGIN

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.usable_bytes and self.memory.host_offload <= self.host_usable_bytes

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.parallel.micro_batch * self.seq_length / (self.parallel.tp * self.parallel.cp) / self.time.total

    @property
    def mfu(self) -> float:
        return self.time.model_flops_per_gpu / self.time.total / self.hardware.flops


def evaluate(m: ModelShape, seq_length: int, num_gpus: int, hw: Hardware, par: Parallel,
             opt: MemoryOptions) -> Plan:
    """Score one configuration (memory and time)."""
    mem = memory_breakdown(m, seq_length, par, opt)
    return Plan(m, seq_length, num_gpus, hw, par, opt, mem, step_time(m, seq_length, par, opt, hw, mem.host_offload))


def _tp_sizes(m: ModelShape, num_gpus: int, hw: Hardware) -> list[int]:
    sizes = []
    for t in (1, 2, 4, 8, 16):
        kv_ok = m.kv_heads % t == 0 or t % m.kv_heads == 0
        if t <= hw.gpus_per_node and num_gpus % t == 0 and m.q_heads % t == 0 and kv_ok:
            sizes.append(t)
    return sizes


def _ulysses_size(m: ModelShape, tp: int, cp: int, hw: Hardware) -> int:
    """Largest all-to-all group inside one node that divides CP and the heads per TP rank."""
    best = 1
    for u in range(2, cp):
        if cp % u == 0 and tp * u <= hw.gpus_per_node and (m.q_heads // tp) % u == 0:
            best = u
    return best


def _parallel_layouts(m: ModelShape, s: int, num_gpus: int, hw: Hardware, c: Constraints,
                      micro_batch: int) -> Iterator[Parallel]:
    for tp in _tp_sizes(m, num_gpus, hw):
        if c.tp is not None and tp != c.tp:
            continue
        rest = num_gpus // tp
        for cp in (d for d in range(1, rest + 1) if rest % d == 0):
            if (c.cp is not None and cp != c.cp) or (cp > 1 and s % (2 * cp)):
                continue
            dp = rest // cp
            ep = math.gcd(m.num_experts, dp * cp) if m.num_experts else 1
            for comm in CP_COMM_TYPES if cp > 1 else ("p2p",):
                if c.cp_comm_type is not None and cp > 1 and comm != c.cp_comm_type:
                    continue
                u = 1
                if comm == "a2a" and (m.q_heads // tp) % cp:
                    continue
                if comm == "a2a+p2p":
                    u = _ulysses_size(m, tp, cp, hw)
                    if u == 1:
                        continue
                yield Parallel(tp=tp, cp=cp, dp=dp, ep=ep, cp_comm_type=comm, ulysses_size=u,
                               micro_batch=micro_batch)


def _memory_options(c: Constraints) -> list[MemoryOptions]:
    """The memory settings to try: the searched grids, narrowed to the user's fixed choices."""
    modes = [(r, o) for r, o in MEMORY_MODES
             if (c.recompute is None or r == c.recompute) and (c.offload is None or o == c.offload)]
    mlp = MLP_TILES if c.tiled_mlp_tiles is None else (c.tiled_mlp_tiles,)
    loss = LOSS_TILES if c.tiled_loss_tiles is None else (c.tiled_loss_tiles,)
    opt_off = (False, True) if c.optimizer_offload is None else (c.optimizer_offload,)
    return [MemoryOptions(recompute=r, offload=o, tiled_mlp_tiles=t_mlp, tiled_loss_tiles=t_loss, optimizer_offload=oo)
            for (r, o), t_mlp, t_loss, oo in itertools.product(modes, mlp, loss, opt_off)]


def all_plans(m: ModelShape, seq_length: int, num_gpus: int, hw: Hardware, constraints: Constraints = Constraints(),
              micro_batch: int = 1) -> list[Plan]:
    """Every candidate configuration, scored (fitting or not)."""
    if seq_length <= 0 or num_gpus <= 0:
        raise ValueError(f"--seq-length {seq_length} and --num-gpus {num_gpus} must be positive")
    options = _memory_options(constraints)
    return [evaluate(m, seq_length, num_gpus, hw, par, opt)
            for par in _parallel_layouts(m, seq_length, num_gpus, hw, constraints, micro_batch) for opt in options]


def recommend(m: ModelShape, seq_length: int, num_gpus: int, hw: Hardware, constraints: Constraints = Constraints(),
              micro_batch: int = 1) -> Plan:
    """The fastest configuration that fits; :class:`PlanInfeasible` when none does."""
    plans = all_plans(m, seq_length, num_gpus, hw, constraints, micro_batch)
    if not plans:
        raise PlanInfeasible(
            f"no parallel layout of {num_gpus} GPUs is valid for {m.name} at --seq-length {seq_length} with the "
            f"fixed choices {_fixed(constraints)}: TP must divide the heads ({m.q_heads}) and fit a node "
            f"({hw.gpus_per_node} GPUs), CP must divide the GPUs left and seq_length/(2·CP) must be whole")
    fitting = [p for p in plans if p.fits]
    if fitting:
        # Within THROUGHPUT_TOLERANCE of the best (closer than the model can tell apart) a plan that
        # leaves COMFORT headroom beats a tight one; then the faster, then the fewer memory features
        # (each can cost more than modelled), then the smaller peak.
        best = max(p.tokens_per_s_per_gpu for p in fitting)
        near = [p for p in fitting if p.tokens_per_s_per_gpu >= (1 - THROUGHPUT_TOLERANCE) * best]
        comfortable = [p for p in near if p.memory.peak <= COMFORT * p.usable_bytes] or near
        return min(comfortable, key=lambda p: (-p.tokens_per_s_per_gpu, features(p.options), p.memory.peak))
    closest = min(plans, key=lambda p: (max(p.memory.peak / p.usable_bytes, p.memory.host_offload / p.host_usable_bytes)))
    host_bound = closest.memory.host_offload > closest.host_usable_bytes
    raise PlanInfeasible(
        f"no configuration of {m.name} at --seq-length {seq_length} fits {num_gpus} x {hw.name} "
        f"({hw.memory_gib:.0f} GiB, {MEMORY_MARGIN:.0%} usable{_fixed_suffix(constraints)}). Closest: "
        f"{describe(closest)} needs {closest.memory.peak / GIB:.1f} GiB per GPU"
        + (f" and {closest.memory.host_offload / GIB:.0f} GiB of host memory per GPU "
           f"(--host-memory-gib-per-gpu {hw.host_memory_gib_per_gpu:.0f})" if host_bound else "")
        + ". Use more GPUs (--num-gpus), a shorter --seq-length, GPUs with more memory, or drop fixed choices."
    )


def features(opt: MemoryOptions) -> int:
    """How many memory features a configuration turns on (recompute, offloads, MLP tiling, loss tiling)."""
    return ((opt.recompute != "none") + (opt.offload != "none") + (opt.tiled_mlp_tiles > 1)
            + (opt.tiled_loss_tiles > 1) + opt.optimizer_offload)


def _fixed(c: Constraints) -> str:
    fixed = {k: v for k, v in dataclasses.asdict(c).items() if v is not None}
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in fixed.items()) or "(none)"


def _fixed_suffix(c: Constraints) -> str:
    fixed = _fixed(c)
    return "" if fixed == "(none)" else f"; fixed: {fixed}"


def describe(plan: Plan) -> str:
    """One line: ``TP2 CP4 (p2p) DP1, recompute full, offload checkpoint, MLP tiles 4, loss tiles 8``."""
    par, opt = plan.parallel, plan.options
    comm = par.cp_comm_type + (f" {par.ulysses_size}x{par.cp // par.ulysses_size}" if par.cp_comm_type == "a2a+p2p" else "")
    text = f"TP{par.tp} CP{par.cp} ({comm}) DP{par.dp}"
    if par.ep > 1:
        text += f" EP{par.ep}"
    return (text + f", recompute {opt.recompute}, offload {opt.offload}, MLP tiles {opt.tiled_mlp_tiles}, "
            f"loss tiles {opt.tiled_loss_tiles}" + (", optimizer on host" if opt.optimizer_offload else ""))
