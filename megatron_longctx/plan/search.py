"""Pick TP / CP / PP size, CP algorithm, recompute, offload and tiling for a model, a sequence and a cluster.

Every candidate is scored with :mod:`.memory` (peak memory per GPU, host bytes per GPU) and
:mod:`.timing` (step time); among those that fit, the one with the most tokens per second per GPU
wins, except that a plan within 3% of it that leaves 10% of the usable memory free beats a tighter one.
Ties (tiling under full recompute costs no time) go to the fewest memory features, then the smaller peak.
Pipeline parallelism is not searched (PP = 1 unless ``--pp`` fixes it): at long context the 1F1B bubble
(p − 1)/m of the few micro-batches per step costs more than CP's communication.  Tile counts come from
the tokens per GPU (≤ 8K tokens per loss tile, ≤ 32K or ≤ 8K per MLP tile, ≤ 32K or ≤ 8K per tile of a
layer replayed in tiles; the MLP tiles then cut one replayed tile).  The layer replay in tiles is tried
where the plugin runs it: full recompute, CP 1 or the all-gather algorithm, TP 1 (it refuses sequence
parallelism, which the searched TP > 1 layouts use), a dense model, the plugin's attention.
:func:`fastest_fitting` is the search; :func:`megatron_longctx.plan.recommend.recommend` adds, when
nothing fits, what :mod:`.advice` says about why and what would.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Iterator, Optional

from .efficiency import Efficiencies, default_efficiencies
from .memory import MemoryBreakdown, memory_breakdown
from .model import GIB, MemoryOptions, ModelShape, Parallel
from .timing import Hardware, StepTime, step_time

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# (recompute, offload) from cheapest in time to cheapest in memory.
MEMORY_MODES = (("none", "none"), ("none", "layers"), ("full", "none"), ("full", "checkpoint"))
LOSS_TOKENS_PER_TILE = (8192, 2048)  # tokens per GPU per loss tile (the logits of 8K tokens: ~8 GiB at 128K vocab)
MLP_TOKENS_PER_TILE = (32768, 8192)
REPLAY_TOKENS_PER_TILE = (32768, 8192)  # tokens per GPU per tile of a layer replayed in tiles
MEMORY_MARGIN = 0.95  # share of the card the allocator can be expected to hand out
HOST_MARGIN = 0.9
THROUGHPUT_TOLERANCE = 0.03
COMFORT = 0.9  # a plan above this share of the usable memory is tight


class PlanInfeasible(ValueError):
    """No configuration fits; the message says what dominates and the smallest change that fits."""


@dataclasses.dataclass(frozen=True)
class Constraints:
    """Choices the user fixed on the command line (None = search), and the job's fixed settings."""

    tp: Optional[int] = None
    cp: Optional[int] = None
    pp: Optional[int] = None
    cp_comm_type: Optional[str] = None
    recompute: Optional[str] = None
    offload: Optional[str] = None
    tiled_mlp_tiles: Optional[int] = None
    tiled_loss_tiles: Optional[int] = None
    recompute_tiles: Optional[int] = None
    optimizer_offload: Optional[bool] = None
    global_batch_size: Optional[int] = None
    # Settings of the job, not searched:
    main_grads_dtype: str = "fp32"
    fsdp: bool = False
    fp8: bool = False
    attention_backend: str = "auto"
    dataloader_mask: bool = False
    model_state_offload: Optional[str] = None  # --longctx-model-state-offload host|disk

    def __post_init__(self) -> None:
        if self.cp_comm_type is not None and self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type {self.cp_comm_type!r}: choose one of {', '.join(CP_COMM_TYPES)}")
        if self.offload == "checkpoint" and self.recompute not in (None, "full"):
            raise ValueError("--offload checkpoint moves the layer inputs that full recompute keeps; "
                             "add --recompute full, or use --offload layers")
        for name in ("tp", "cp", "pp", "tiled_mlp_tiles", "tiled_loss_tiles", "recompute_tiles",
                     "global_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value}: give an integer >= 1")
        if self.model_state_offload and self.optimizer_offload:
            raise ValueError("--model-state-offload runs its own AdamW off the device: drop --optimizer-offload "
                             "(Megatron's --optimizer-cpu-offload)")
        tiles = self.recompute_tiles or 1
        if tiles > 1 and self.recompute not in (None, "full"):
            raise ValueError(f"--recompute-tiles {tiles} replays the layers of full recompute in tiles: add "
                             "--recompute full, or drop --recompute-tiles")
        if tiles > 1 and self.cp_comm_type not in (None, "all_gather") and self.cp not in (None, 1):
            raise ValueError(f"--recompute-tiles {tiles} gathers K/V once per layer over CP: add --cp-comm-type "
                             "all_gather (or --cp 1), or drop --recompute-tiles")
        MemoryOptions(main_grads_dtype=self.main_grads_dtype, attention_backend=self.attention_backend,
                      fsdp=self.fsdp, model_state_offload=self.model_state_offload, recompute="full" if tiles > 1 else "none",
                      recompute_tiles=tiles)  # validates the job's settings

    def fixed(self) -> dict:
        """The searched choices the user fixed (name -> value)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if v is not None and k in _SEARCHED}


_SEARCHED = ("tp", "cp", "pp", "cp_comm_type", "recompute", "offload", "tiled_mlp_tiles", "tiled_loss_tiles",
             "recompute_tiles", "optimizer_offload")


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
    efficiencies: Efficiencies = None

    @property
    def usable_bytes(self) -> float:
        return self.hardware.memory_gib * GIB * MEMORY_MARGIN

    @property
    def host_usable_bytes(self) -> float:
        return self.hardware.host_bytes_per_gpu(self.num_gpus) * HOST_MARGIN

    @property
    def fits(self) -> bool:
        return self.memory.peak <= self.usable_bytes and self.memory.host_offload <= self.host_usable_bytes

    @property
    def global_batch_size(self) -> int:
        return self.parallel.micro_batch * self.parallel.micro_batches * self.parallel.dp

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.global_batch_size * self.seq_length / self.parallel.world / self.time.total

    @property
    def tflops_per_gpu(self) -> float:
        """Achieved TFLOP/s per GPU in Megatron's ``num_floating_point_operations`` convention."""
        return self.time.model_flops_per_gpu / self.time.total / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation (Megatron's convention) against the dense bf16 peak."""
        return self.time.model_flops_per_gpu / self.time.total / self.hardware.flops

    def time_at(self, which: str) -> StepTime:
        """The step time at the ``low`` / ``expected`` / ``high`` efficiencies."""
        return step_time(self.model, self.seq_length, self.parallel, self.options, self.hardware,
                         self.memory.activation_host, self.efficiencies.point(which, self.parallel.cp))

    @property
    def time_range(self) -> tuple[float, float]:
        """(fastest, slowest) step seconds over the efficiency bands."""
        return self.time_at("high").total, self.time_at("low").total


def evaluate(m: ModelShape, seq_length: int, num_gpus: int, hw: Hardware, par: Parallel, opt: MemoryOptions,
             eff: Optional[Efficiencies] = None) -> Plan:
    """Score one configuration (memory and time)."""
    eff = eff or default_efficiencies(hw.family, opt.attention_backend, opt.fp8)
    mem = memory_breakdown(m, seq_length, par, opt)
    t = step_time(m, seq_length, par, opt, hw, mem.activation_host, eff.point("expected", par.cp))
    return Plan(m, seq_length, num_gpus, hw, par, opt, mem, t, eff)


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
    pp = c.pp or 1
    if num_gpus % pp or m.num_layers < pp:
        return
    for tp in _tp_sizes(m, num_gpus // pp, hw):
        if c.tp is not None and tp != c.tp:
            continue
        rest = num_gpus // (tp * pp)
        for cp in (d for d in range(1, rest + 1) if rest % d == 0):
            if (c.cp is not None and cp != c.cp) or (cp > 1 and s % (2 * cp)):
                continue
            dp = rest // cp
            gbs = c.global_batch_size or micro_batch * dp
            if gbs % (micro_batch * dp):
                continue
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
                               micro_batch=micro_batch, pp=pp, micro_batches=gbs // (micro_batch * dp))


def _pow2_at_least(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1.0))))


def tile_choices(tokens_per_gpu: float, per_tile: tuple[int, ...]) -> tuple[int, ...]:
    """1 (off) and, per target, the power of two that brings the tokens of one tile under it."""
    return tuple(sorted({1, *(_pow2_at_least(tokens_per_gpu / t) for t in per_tile)}))


def replay_allowed(m: ModelShape, par: Parallel, c: Constraints) -> bool:
    """Whether the layers of full recompute can be replayed in sequence tiles for this layout and job.

    What :func:`.model.check_recompute_tiles` and the plugin refuse: CP > 1 without all-gather, TP > 1
    (the searched layouts run sequence parallelism), MoE, Megatron's own TE attention (te_cudnn).
    """
    return ((par.cp == 1 or par.cp_comm_type == "all_gather") and par.tp == 1 and m.num_experts is None
            and c.attention_backend != "te_cudnn")


def _memory_options(c: Constraints, tokens_per_gpu: float, replay: bool = False) -> list[MemoryOptions]:
    """The memory settings to try: the searched grids, narrowed to the user's fixed choices.

    ``replay``: the layout allows full recompute in sequence tiles (:func:`replay_allowed`)."""
    modes = [(r, o) for r, o in MEMORY_MODES
             if (c.recompute is None or r == c.recompute) and (c.offload is None or o == c.offload)]
    if c.recompute_tiles is not None:
        replays: tuple[int, ...] = (c.recompute_tiles,)
    else:
        replays = tile_choices(tokens_per_gpu, REPLAY_TOKENS_PER_TILE) if replay else (1,)
    loss = tile_choices(tokens_per_gpu, LOSS_TOKENS_PER_TILE) if c.tiled_loss_tiles is None else (c.tiled_loss_tiles,)
    if c.model_state_offload:  # its own optimizer off the device replaces Megatron's
        opt_off: tuple[bool, ...] = (False,)
    else:
        opt_off = (False, True) if c.optimizer_offload is None else (c.optimizer_offload,)
    job = dict(main_grads_dtype=c.main_grads_dtype, fsdp=c.fsdp, fp8=c.fp8, attention_backend=c.attention_backend,
               dataloader_mask=c.dataloader_mask, model_state_offload=c.model_state_offload)
    out = []
    for (r, o), t_replay in itertools.product(modes, replays):
        if t_replay > 1 and (r != "full" or not replay):
            continue
        # Under a tiled replay the MLP sees one replayed tile: its tiles are sized for that.
        mlp = ((c.tiled_mlp_tiles,) if c.tiled_mlp_tiles is not None
               else tile_choices(tokens_per_gpu / t_replay, MLP_TOKENS_PER_TILE))
        out += [MemoryOptions(recompute=r, offload=o, tiled_mlp_tiles=t_mlp, tiled_loss_tiles=t_loss,
                              recompute_tiles=t_replay, optimizer_offload=oo, **job)
                for t_mlp, t_loss, oo in itertools.product(mlp, loss, opt_off)]
    return out


def all_plans(m: ModelShape, seq_length: int, num_gpus: int, hw: Hardware, constraints: Constraints = Constraints(),
              micro_batch: int = 1, eff: Optional[Efficiencies] = None) -> list[Plan]:
    """Every candidate configuration, scored (fitting or not)."""
    if seq_length <= 0 or num_gpus <= 0:
        raise ValueError(f"--seq-length {seq_length} and --num-gpus {num_gpus} must be positive")
    plans = []
    for par in _parallel_layouts(m, seq_length, num_gpus, hw, constraints, micro_batch):
        replay = replay_allowed(m, par, constraints)
        if (constraints.recompute_tiles or 1) > 1 and not replay:
            continue
        for opt in _memory_options(constraints, par.micro_batch * seq_length / par.cp, replay):
            plans.append(evaluate(m, seq_length, num_gpus, hw, par, opt, eff))
    return plans


def best_fitting(plans: list[Plan]) -> Optional[Plan]:
    """The recommender's pick among ``plans`` (None when none fits)."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        return None
    # Within THROUGHPUT_TOLERANCE of the best (closer than the model can tell apart) a plan that
    # leaves COMFORT headroom beats a tight one; then the faster, then the fewer memory features
    # (each can cost more than modelled), then the smaller peak.
    best = max(p.tokens_per_s_per_gpu for p in fitting)
    near = [p for p in fitting if p.tokens_per_s_per_gpu >= (1 - THROUGHPUT_TOLERANCE) * best]
    comfortable = [p for p in near if p.memory.peak <= COMFORT * p.usable_bytes] or near
    return min(comfortable, key=lambda p: (-p.tokens_per_s_per_gpu, features(p.options), p.memory.peak))


def closest(plans: list[Plan]) -> Plan:
    """The plan that misses by the least (largest of its GPU and host over-use ratios)."""
    return min(plans, key=lambda p: max(p.memory.peak / p.usable_bytes, p.memory.host_offload / p.host_usable_bytes))


def fastest_fitting(m: ModelShape, seq_length: int, num_gpus: int, hw: Hardware,
                    constraints: Constraints = Constraints(), micro_batch: int = 1,
                    eff: Optional[Efficiencies] = None) -> tuple[Optional[Plan], list[Plan]]:
    """``(the fastest configuration that fits or None, every candidate scored)``; :class:`PlanInfeasible`
    when no parallel layout is valid for the fixed choices."""
    plans = all_plans(m, seq_length, num_gpus, hw, constraints, micro_batch, eff)
    if not plans:
        gbs = (f", --global-batch-size {constraints.global_batch_size} must be a multiple of "
               f"--micro-batch-size × DP" if constraints.global_batch_size else "")
        replay = ("; --recompute-tiles needs TP 1 (the plan runs sequence parallelism at TP > 1), CP 1 or "
                  "--cp-comm-type all_gather, a dense model and the plugin's attention (not te_cudnn)"
                  if (constraints.recompute_tiles or 1) > 1 else "")
        raise PlanInfeasible(
            f"no parallel layout of {num_gpus} GPUs is valid for {m.name} at --seq-length {seq_length} with the "
            f"fixed choices {_fixed(constraints)}: TP must divide the heads ({m.q_heads}) and fit a node "
            f"({hw.gpus_per_node} GPUs), --pp must divide the GPUs and the layers, CP must divide the GPUs left "
            f"and seq_length/(2·CP) must be whole{gbs}{replay}")
    return best_fitting(plans), plans


def features(opt: MemoryOptions) -> int:
    """How many memory features a configuration turns on (recompute, offloads, MLP / loss / replay tiling)."""
    return ((opt.recompute != "none") + (opt.offload != "none") + (opt.tiled_mlp_tiles > 1)
            + (opt.tiled_loss_tiles > 1) + (opt.recompute_tiles > 1) + opt.optimizer_offload)


def _fixed(c: Constraints) -> str:
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in c.fixed().items()) or "(none)"


def describe(plan: Plan) -> str:
    """One line: ``TP2 CP4 (p2p) DP1, recompute full, offload checkpoint, MLP tiles 4, loss tiles 8``
    (``, recompute tiles N`` when the replay runs in tiles)."""
    par, opt = plan.parallel, plan.options
    comm = par.cp_comm_type + (f" {par.ulysses_size}x{par.cp // par.ulysses_size}" if par.cp_comm_type == "a2a+p2p" else "")
    text = f"TP{par.tp} CP{par.cp} ({comm})" + (f" PP{par.pp}" if par.pp > 1 else "") + f" DP{par.dp}"
    if par.ep > 1:
        text += f" EP{par.ep}"
    text += (f", recompute {opt.recompute}, offload {opt.offload}, MLP tiles {opt.tiled_mlp_tiles}, "
             f"loss tiles {opt.tiled_loss_tiles}" + (f", recompute tiles {opt.recompute_tiles}"
                                                      if opt.recompute_tiles > 1 else "")
             + (", optimizer on host" if opt.optimizer_offload else ""))
    if opt.model_state_offload:
        text += f", model states on {opt.model_state_offload}"
    return text
