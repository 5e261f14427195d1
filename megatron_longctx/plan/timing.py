"""Analytic step time: matmul and attention FLOPs, TP / CP / PP / DP / offload traffic, and what overlaps.

FLOPs: 6·N per token for the matmuls (Kaplan et al. 2020); causal attention per layer
fwd ≈ 2·b·s²·H, fwd+bwd ≈ 7·b·s²·H (FlashAttention-2 backward ≈ 2.5× forward), 9·b·s²·H when full
recompute replays the forward.  Achieved rates are peak × an efficiency per GPU generation and kernel
backend (:mod:`.efficiency`).  CP traffic per rank per layer (forward; backward moves K/V and dK/dV):
ring / all-gather (P−1)/P·2·b·s·hkv·d·e; Ulysses (DeepSpeed-Ulysses, arXiv:2309.14509) four
all-to-alls of (P−1)/P²·b·s·d·(2hq+2hkv)·e together.  Ring attention (Liu et al. arXiv:2310.01889)
hides its transfers while each step's block compute is longer than the block's transfer, i.e. when
tokens per GPU c ≥ (F/B)·(hkv/hq)·e/k (k = 1 causal zigzag, 2 full).  Pipeline parallelism runs 1F1B
(Narayanan et al. arXiv:2104.04473): a step of m micro-batches takes (m + p − 1) stage times, the
bubble (p − 1)/m of the useful time.

All-gather CP moves K/V as the plugin's all-gather attention does: gathered in forward, gathered
again in backward (not kept), dK/dV reduce-scattered; full recompute gathers once more in its replay.
Full recompute in ``N`` sequence tiles (``--longctx-recompute-tiles``) reruns each tile's input norm
and Q/K/V projection (+ RoPE) in its K/V-collect pass, in forward and in backward, and in backward's
K/V-gradient pass, which also backpropagates dK/dV through that projection again: 5 projection
forwards' worth of GEMM FLOPs per layer more than plain full recompute, and one gather fewer.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .flops import attention_hidden, model_flops
from .model import MemoryOptions, ModelShape, Parallel, check_recompute_tiles, param_counts
from .state_offload import HOST_ADAM_PARAMS_PER_S, state_offload
from .states import stage_params

OFFLOAD_CONTENTION = 0.05  # share of a hidden device<->host copy that still slows compute
TILE_OVERHEAD_S = 1e-4  # per tile and pass of tiled MLP / tiled loss / tiled replay
# A layer replayed in sequence tiles: passes over the tiles (forward: collect K/V, attend; backward:
# collect, attend + backward, K/V gradients), and the extra Q/K/V-projection forwards' worth of GEMM
# FLOPs (collect in forward and backward, the K/V-gradient pass's forward and its dgrad + wgrad).
REPLAY_PASSES = 5
REPLAY_QKV_FORWARDS = 5
FAMILIES = ("hopper", "blackwell", "ampere")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU model and its links; bandwidths are per GPU, per direction, in bytes/s."""

    name: str
    memory_gib: float
    bf16_tflops: float  # dense peak
    intra_node_gbps: float  # NVLink (GB/s)
    inter_node_gbps: float  # InfiniBand / RoCE per GPU (GB/s)
    host_gbps: float  # PCIe / C2C to pinned host memory (GB/s)
    gpus_per_node: int = 8
    host_memory_gib: float = 2048.0  # per node, shared by the job's GPUs on it
    fp8_tflops: float = 0.0  # dense FP8 peak (0: no FP8 tensor cores)
    family: str = "hopper"  # GPU generation: picks the default efficiencies
    link_efficiency: float = 0.8  # achieved / nominal bandwidth
    # Local NVMe read/write per GPU (GB/s): a DGX H100/H200 node's eight U.2 data drives in RAID 0 reach
    # ~50 GB/s together (NVIDIA DGX H100 user guide), shared by 8 GPUs.  Model-state offload's disk tier.
    nvme_gbps: float = 6.0
    step_latency_s: float = 20e-6  # one ring step / collective launch

    def __post_init__(self) -> None:
        for name in ("memory_gib", "bf16_tflops", "intra_node_gbps", "inter_node_gbps", "host_gbps",
                     "host_memory_gib", "gpus_per_node", "nvme_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')}: got {getattr(self, name)}; give a positive number")
        if self.fp8_tflops < 0:
            raise ValueError(f"--fp8-tflops: got {self.fp8_tflops}; give a number >= 0")
        if self.family not in FAMILIES:
            raise ValueError(f"GPU family {self.family!r}: choose one of {', '.join(FAMILIES)}")

    @property
    def flops(self) -> float:
        return self.bf16_tflops * 1e12

    def host_bytes_per_gpu(self, num_gpus: int) -> float:
        """A node's host memory divided among the job's GPUs on that node."""
        return self.host_memory_gib * (1 << 30) / min(num_gpus, self.gpus_per_node)


def attention_flops(b: int, s: int, hidden: float, *, causal: bool = True, backward: bool = True,
                    recompute: bool = False) -> float:
    """FLOPs of one layer's attention core over the whole sequence: ``2·b·s²·H`` causal forward."""
    fwd = 2.0 * b * s * s * hidden * (1.0 if causal else 2.0)
    if not backward:
        return fwd
    return fwd * (3.5 + (1.0 if recompute else 0.0))


def ring_bytes(b: int, s: int, kv_heads: float, d_qk: int, d_v: int, p: int, e: int) -> float:
    """Bytes each rank receives per layer in the forward of ring (or all-gather) attention."""
    return (p - 1) / p * b * s * kv_heads * (d_qk + d_v) * e


def ulysses_bytes(b: int, s: int, q_heads: float, kv_heads: float, d: int, p: int, e: int) -> float:
    """Bytes each rank sends per layer in Ulysses' forward: q, k, v in and the output back."""
    return (p - 1) / (p * p) * b * s * d * (2 * q_heads + 2 * kv_heads) * e


def ring_overlap_tokens(m: ModelShape, hw: Hardware, *, inter_node: bool, e: int = 2, causal: bool = True) -> float:
    """Tokens per GPU above which ring attention hides its K/V transfers behind compute."""
    bw = (hw.inter_node_gbps if inter_node else hw.intra_node_gbps) * 1e9
    k = 1 if causal else 2
    return hw.flops / bw * (m.kv_heads / m.q_heads) * e / k


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one training step (all micro-batches of one data-parallel rank), by part."""

    matmul: float
    attention: float
    cp_exposed: float
    tp_comm: float
    pp_bubble: float  # 1F1B fill and drain: (p − 1) stage times of one micro-batch
    pp_comm: float  # activations and their gradients between stages
    dp_exposed: float
    offload_exposed: float
    model_flops_per_gpu: float  # Megatron's num_floating_point_operations of the step / GPUs (no recompute)
    micro_batches: int = 1
    layer_forward_s: float = 0.0  # one layer's forward on this GPU (what a layer's copies hide behind)

    @property
    def total(self) -> float:
        return (self.matmul + self.attention + self.cp_exposed + self.tp_comm + self.pp_bubble + self.pp_comm
                + self.dp_exposed + self.offload_exposed)

    PARTS = ("matmul", "attention", "cp_exposed", "tp_comm", "pp_bubble", "pp_comm", "dp_exposed",
             "offload_exposed")


def _cp_link(par: Parallel, hw: Hardware) -> float:
    inter = par.tp * par.cp > hw.gpus_per_node  # TP innermost, then CP
    return (hw.inter_node_gbps if inter else hw.intra_node_gbps) * 1e9 * hw.link_efficiency


def cp_times(m: ModelShape, s: int, par: Parallel, hw: Hardware, attn_fwd_s: float, e: int,
             kv_gathers: int = 2) -> tuple[float, float]:
    """(attention seconds incl. overlapped transfers, exposed CP communication) for one layer fwd+bwd.

    ``kv_gathers``: all-gathers of K/V per layer under all-gather CP (2: forward and backward; plain
    full recompute's replay adds one), each with the one reduce-scatter of dK/dV exposed.
    """
    attn_bwd_s = attn_fwd_s * 2.5
    p, b = par.cp, par.micro_batch
    if p == 1:
        return attn_fwd_s + attn_bwd_s, 0.0
    hq, hkv = m.q_heads / par.tp, max(m.kv_heads / par.tp, 1)
    lat = hw.step_latency_s
    if par.cp_comm_type == "p2p":
        fwd = ring_bytes(b, s, hkv, m.d_qk, m.d_v, p, e) / _cp_link(par, hw)
        t_f, t_b = max(attn_fwd_s, fwd), max(attn_bwd_s, 2 * fwd)  # backward moves K/V and dK/dV
        exposed = (t_f - attn_fwd_s) + (t_b - attn_bwd_s) + 2 * p * lat
        return attn_fwd_s + attn_bwd_s, exposed
    if par.cp_comm_type == "all_gather":
        fwd = ring_bytes(b, s, hkv, m.d_qk, m.d_v, p, e) / _cp_link(par, hw)
        return attn_fwd_s + attn_bwd_s, (kv_gathers + 1) * (fwd + lat)  # gathers of K/V, reduce-scatter dK/dV
    if par.cp_comm_type == "a2a":
        a2a = ulysses_bytes(b, s, hq, max(hkv, p), max(m.d_qk, m.d_v), p, e) / _cp_link(par, hw)
        return attn_fwd_s + attn_bwd_s, 2 * a2a + 8 * lat
    u, r = par.ulysses_size, p // par.ulysses_size  # a2a+p2p: Ulysses inside the node, ring across
    intra = hw.intra_node_gbps * 1e9 * hw.link_efficiency
    inter = hw.inter_node_gbps * 1e9 * hw.link_efficiency if r > 1 and par.tp * p > hw.gpus_per_node else intra
    a2a = ulysses_bytes(b, s // r, hq, max(hkv, u), max(m.d_qk, m.d_v), u, e) / intra
    ring = ring_bytes(b, s, max(hkv / u, 1), m.d_qk, m.d_v, r, e) / inter if r > 1 else 0.0
    t_f, t_b = max(attn_fwd_s, ring), max(attn_bwd_s, 2 * ring)
    exposed = (t_f - attn_fwd_s) + (t_b - attn_bwd_s) + 2 * a2a + (2 * r + 8) * lat
    return attn_fwd_s + attn_bwd_s, exposed


def _matmul_rate(hw: Hardware, opt: MemoryOptions, matmul_eff: float) -> float:
    if opt.fp8:
        if hw.fp8_tflops <= 0:
            raise ValueError(f"--fp8: {hw.name} has no FP8 tensor cores (--fp8-tflops 0); drop --fp8")
        return hw.fp8_tflops * 1e12 * matmul_eff
    return hw.flops * matmul_eff


def step_time(m: ModelShape, s: int, par: Parallel, opt: MemoryOptions, hw: Hardware, host_bytes: float = 0.0,
              eff: Optional[tuple[float, float]] = None) -> StepTime:
    """Predicted seconds of one step on one GPU; ``eff`` = (attention, matmul) efficiency.

    Without ``eff`` the expected defaults of :mod:`.efficiency` for the GPU family, the attention
    backend and the GEMM precision.  Per micro-batch the GPU runs its stage (1/pp of the layers, load
    balanced); the step is ``m`` of those plus the 1F1B bubble, the exposed gradient reduction once and
    the host optimizer step.  ``host_bytes``: activation bytes one micro-batch offloads to the host.
    """
    if eff is None:
        from .efficiency import default_efficiencies

        eff = default_efficiencies(hw.family, opt.attention_backend, opt.fp8).point("expected", par.cp)
    attention_eff, matmul_eff = eff
    e, b, t, pp, mb = opt.bytes_per_element, par.micro_batch, par.tp, par.pp, par.micro_batches
    n = b * s / par.cp  # tokens on this GPU
    pc = param_counts(m)
    layer_params = pc.attention + (pc.moe_active if m.num_experts else pc.dense_mlp)
    mm_fwd_layer = 2 * n * layer_params / t
    logits_fwd = 2 * n * m.hidden_size * m.vocab_size / t
    attn_fwd_layer = attention_flops(b, s, attention_hidden(m), backward=False) / (par.cp * t)
    rate = _matmul_rate(hw, opt, matmul_eff)

    replay = opt.recompute == "full"
    replay_tiles = opt.recompute_tiles  # > 1: the replay runs one sequence tile at a time
    check_recompute_tiles(m, par, opt)
    mlp_share = (pc.moe_active if m.num_experts else pc.dense_mlp) / layer_params
    extra_mlp = 0.0 if replay or opt.tiled_mlp_tiles == 1 else mm_fwd_layer * mlp_share  # TiledMLP replay
    extra_loss = logits_fwd if opt.tiled_loss_tiles > 1 else 0.0
    mm_flops = m.num_layers * (3 * mm_fwd_layer + (mm_fwd_layer if replay else extra_mlp)) + 3 * logits_fwd
    mm_flops += extra_loss
    if replay_tiles > 1:  # the Q/K/V projections before core attention, rerun per pass
        qkv_params = pc.attention - m.q_heads * m.d_v * m.hidden_size  # all but the output projection
        mm_flops += m.num_layers * REPLAY_QKV_FORWARDS * 2 * n * qkv_params / t
    matmul_s = mm_flops / rate
    if opt.tiled_mlp_tiles > 1:  # smaller GEMMs and a launch per tile, forward and backward (per replayed tile)
        matmul_s += m.num_layers * 2 * opt.tiled_mlp_tiles * replay_tiles * TILE_OVERHEAD_S
    if opt.tiled_loss_tiles > 1:
        matmul_s += 2 * opt.tiled_loss_tiles * TILE_OVERHEAD_S
    if replay_tiles > 1:
        matmul_s += m.num_layers * REPLAY_PASSES * replay_tiles * TILE_OVERHEAD_S

    attn_fwd_s = attn_fwd_layer / (hw.flops * attention_eff)
    kv_gathers = 3 if replay and replay_tiles == 1 else 2
    attn_s, cp_exposed = cp_times(m, s, par, hw, attn_fwd_s, e, kv_gathers)
    attention_s = m.num_layers * (attn_s + (attn_fwd_s if replay else 0.0))
    cp_s = m.num_layers * cp_exposed

    tp_s = 0.0
    if t > 1:  # sequence parallel: 2 all-gathers + 2 reduce-scatters forward; backward ≈ 1.5× that
        unit = (t - 1) / t * n * m.hidden_size * e / (hw.intra_node_gbps * 1e9 * hw.link_efficiency)
        # A tiled replay's K/V-gradient pass all-reduces the projection's input gradient once more.
        tp_s = m.num_layers * unit * (10 + (4 if replay else 0) + (2 if replay_tiles > 1 else 0))

    # Everything above is one micro-batch through the whole model; a GPU runs 1/pp of it per micro-batch.
    stage_s = (matmul_s + attention_s + cp_s + tp_s) / pp
    off_s = _activation_offload_s(m, par, opt, hw, host_bytes, mm_fwd_layer / rate + attn_fwd_s)
    pp_comm = 0.0
    if pp > 1:  # one activation forward and its gradient back per stage boundary and micro-batch
        sp = t if opt.sequence_parallel else 1
        link = hw.inter_node_gbps if par.world > hw.gpus_per_node else hw.intra_node_gbps
        pp_comm = mb * 2 * (n * m.hidden_size * e / sp) / (link * 1e9 * hw.link_efficiency)
    bubble = (pp - 1) * (stage_s + off_s)
    useful = model_flops(m, s, b * mb, "megatron") / (t * par.cp * pp)
    return StepTime(matmul_s * mb / pp, attention_s * mb / pp, cp_s * mb / pp, tp_s * mb / pp, bubble, pp_comm,
                    _dp_exposed_s(m, par, opt, hw), mb * off_s + _optimizer_host_s(m, par, opt, hw),
                    useful, mb, mm_fwd_layer / rate + attn_fwd_s)


def _dp_exposed_s(m: ModelShape, par: Parallel, opt: MemoryOptions, hw: Hardware) -> float:
    """Gradient reduce-scatter + parameter all-gather, overlapped but for the last bucket (once a step)."""
    group = par.dp * par.cp
    if group == 1:
        return 0.0
    sp = stage_params(m, par)
    link = hw.inter_node_gbps if par.world > hw.gpus_per_node else hw.intra_node_gbps
    g = 4 if opt.main_grads_dtype == "fp32" else 2
    dp_bytes = (group - 1) / group * (g + 2) * sp.total * (1.5 if opt.fsdp else 1.0)  # FSDP: re-gather in bwd
    return dp_bytes / (link * 1e9 * hw.link_efficiency) / sp.layers + 2 * hw.step_latency_s


def _optimizer_host_s(m: ModelShape, par: Parallel, opt: MemoryOptions, hw: Hardware) -> float:
    """Host optimizer step, once a step and not overlapped: Megatron's hybrid optimizer (fp32 grads down,
    params up, CPU Adam), or model-state offload's CPU AdamW (its grads are on the host already and its
    weights stay there; ``disk`` adds the moments' NVMe traffic)."""
    so = state_offload(m, par, opt)
    if so is not None:
        return so.optimizer_step_s(hw)
    if not opt.optimizer_offload:
        return 0.0
    sp = stage_params(m, par)
    host_link = hw.host_gbps * 1e9 * hw.link_efficiency
    shard = sp.total / max(par.dp * par.cp, 1)
    return 6 * shard / host_link + shard / HOST_ADAM_PARAMS_PER_S


def _activation_offload_s(m: ModelShape, par: Parallel, opt: MemoryOptions, hw: Hardware, host_bytes: float,
                          fwd_layer_s: float) -> float:
    """Exposed host copies of one micro-batch on this GPU's stage: activations out and back, model states."""
    host_link = hw.host_gbps * 1e9 * hw.link_efficiency
    off_s = 0.0
    sp = stage_params(m, par)
    so = state_offload(m, par, opt)
    if so is not None:  # per layer: weights in for the forward and again for the backward, grads out
        layer = so.layer_copies(hw, fwd_layer_s, opt.recompute == "full")
        off_s += sp.layers * (layer.exposed_s + OFFLOAD_CONTENTION * layer.copy_s) + so.other_copies_s(hw)
    act = host_bytes
    if act > 0:  # activations: copy out in forward, back in backward, one layer at a time
        per_layer = act / sp.layers / host_link
        # Copies share HBM bandwidth with compute: charge a share of them even when hidden.
        off_s += sp.layers * 2 * (max(0.0, per_layer - fwd_layer_s) + OFFLOAD_CONTENTION * per_layer)
    return off_s

