"""Peak bytes of one GPU: model states, saved activations of the in-flight micro-batches, transients.

The peak of a pipeline stage is its model states (:mod:`.states`) + the activations its layers save
for every micro-batch in flight (1F1B: the first stage holds ``min(pp, m)``, the last one) + the
largest transient of one layer: the recompute/backward working set, the attention workspace (CP
buffers, fp32 dQ, the FlashAttention-2 GQA dK/dV expansion), the sequence-parallel all-gather of the
layer input under TP, or the logits of the loss; plus Megatron's dense dataloader mask when it is on,
and a fixed reserve (CUDA context, NCCL buffers, allocator slack).  PP = 1 is one stage that is both.

Full recompute replayed in ``N`` sequence tiles (``--longctx-recompute-tiles``,
:mod:`megatron_longctx.memory.tiled_recompute`) holds in backward the layer's input and output
gradients, one tile's share of the recompute working set, and as attention workspace the whole
sequence's K/V with their fp32 gradient sums (at every CP size); an offloaded layer input comes back
one tile at a time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

from .efficiency import GQA_EXPANDING_BACKENDS
from .model import GIB, LayerActivations, MemoryOptions, ModelShape, Parallel, check_recompute_tiles, layer_activations
from .state_offload import state_offload
from .states import model_states

RESERVED_GIB = 3.0
# Keys per kernel call of a tile's attention (megatron_longctx.attention.tiled.KEY_BLOCK): FlashAttention-2's
# GQA dK/dV expansion holds at most this many keys under a tiled replay.
REPLAY_KEY_BLOCK = 2048
# Megatron's GPTDataset builds the mask as float32 ``torch.tril(ones(s, s))`` and compares it into a
# bool one: 5 bytes per element on the host while a sample is made, 1 byte per element on the GPU.
MASK_HOST_BYTES_PER_ELEMENT = 5


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted peak bytes per GPU (its worst pipeline stage), by part, and the host bytes per GPU."""

    weights: float
    grads: float
    optimizer: float
    activations: float  # saved for backward across the stage's layers and in-flight micro-batches
    working: float  # one layer's recompute/backward working set (full recompute, its tiled replay, tiled MLP)
    attention_workspace: float  # CP buffers, gathered K/V (+ dK/dV), fp32 dq accumulators, FA2's GQA dK/dV
    sp_gather: float  # sequence parallel: the all-gathered layer input [s/cp, b, h] under TP
    logits: float  # logits + fp32 softmax of the loss (divided by loss tiles)
    dataloader_mask: float  # Megatron's dense [b, 1, s, s] bool mask on the GPU (0 when off)
    reserved: float  # CUDA context, NCCL buffers, allocator slack
    host_offload: float  # bytes in host memory for this GPU (activations, optimizer, model states, mask)
    activation_host: float = 0.0  # activation bytes one micro-batch moves to the host (per GPU)
    stage: str = "first"  # which pipeline stage is the peak ("first" or "last"; PP = 1: the only one)
    per_layer: LayerActivations = field(repr=False, default=None)
    grads_bf16: bool = False  # main grads kept in bf16 (--main-grads-dtype bf16)
    disk_offload: float = 0.0  # bytes on the local NVMe for this GPU (model-state offload to disk)

    @property
    def model_states(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def transient(self) -> float:
        return max(self.logits, self.working + self.attention_workspace) + self.sp_gather

    @property
    def peak(self) -> float:
        return self.model_states + self.activations + self.transient + self.dataloader_mask + self.reserved

    def rows(self) -> list[tuple[str, float]]:
        grads = "grads (bf16 buffer)" if self.grads_bf16 else "grads (fp32 buffer)"
        rows = [("weights (bf16)", self.weights), (grads, self.grads),
                ("optimizer (dist., fp32 m/v/master)", self.optimizer), ("activations saved", self.activations),
                ("layer working set", self.working), ("attention workspace", self.attention_workspace),
                ("SP all-gather (TP)", self.sp_gather), ("logits + loss", self.logits),
                ("dataloader mask", self.dataloader_mask), ("reserved", self.reserved), ("peak", self.peak),
                ("host (offload)", self.host_offload), ("disk (model states)", self.disk_offload)]
        return [(n, v) for n, v in rows if v or n in ("peak", "weights (bf16)", grads, "activations saved")]

    def dominant(self) -> tuple[str, float]:
        """The largest part of the GPU peak (name, bytes)."""
        parts = [(n, v) for n, v in self.rows() if n not in ("peak", "host (offload)")]
        return max(parts, key=lambda nv: nv[1])


def saved_per_layer(m: ModelShape, s: int, par: Parallel, opt: MemoryOptions, moe_layer: bool = False) -> float:
    """Bytes one layer keeps on the GPU from its forward to its backward, before any offload.

    Full recompute keeps the layer input ``[s/cp (/tp under SP), b, h]`` only; TiledMLP keeps the
    MLP's input instead of its intermediates; otherwise :func:`.model.layer_activations`.
    """
    if opt.recompute == "full":
        sp = par.tp if opt.sequence_parallel else 1
        return par.micro_batch * s / par.cp * m.hidden_size * opt.bytes_per_element / sp
    a = layer_activations(m, s, par, opt, moe_layer=moe_layer)
    return a.total - (a.mlp if opt.tiled_mlp_tiles > 1 else 0.0)


def fa2_gqa_bytes(m: ModelShape, s: int, par: Parallel, opt: MemoryOptions) -> float:
    """FlashAttention-2's backward under GQA: dK and dV expanded to every query head, then summed.

    flash-attn 2 (and SDPA's flash path) allocates ``[b, s_k, hq, d]`` dK/dV in the input dtype when
    ``hq > hkv``; ``s_k`` is one block's keys: the local chunk for ring / Ulysses, all of them for
    all-gather.  FA3 and cuDNN reduce over the group in the kernel.
    """
    if opt.attention_backend not in GQA_EXPANDING_BACKENDS or m.q_heads <= m.kv_heads:
        return 0.0
    n = par.micro_batch * s / par.cp
    keys = n * par.cp if par.cp_comm_type == "all_gather" else n
    if opt.recompute_tiles > 1:  # a tile's attention calls take at most REPLAY_KEY_BLOCK keys each
        keys = par.micro_batch * min(REPLAY_KEY_BLOCK, s)
    return keys * m.q_heads / par.tp * (m.d_qk + m.d_v) * opt.bytes_per_element


def attention_workspace_bytes(m: ModelShape, s: int, par: Parallel, e: int) -> float:
    """Transient bytes inside one layer's CP attention (forward or backward, the larger)."""
    n = par.micro_batch * s / par.cp
    hq, hkv = m.q_heads / par.tp, max(m.kv_heads / par.tp, 1)
    kv = n * hkv * (m.d_qk + m.d_v)  # elements of this rank's K and V
    dq = n * hq * m.d_qk * 4 + n * hq * 4  # fp32 dq accumulator + lse/delta
    if par.cp == 1:
        return dq
    if par.cp_comm_type == "p2p":
        return dq + kv * (2 * e + 2 * 4)  # K/V in flight (send+recv), dK/dV in flight in fp32
    if par.cp_comm_type == "all_gather":
        return dq + par.cp * kv * (e + 4)  # gathered K/V and their fp32 gradients
    if par.cp_comm_type == "a2a":
        return dq + 2 * n * (hq * (m.d_qk + m.d_v) + kv / n) * e  # re-laid q/k/v/out, send + receive
    u = par.ulysses_size  # a2a+p2p: all-to-all, then a ring over cp/u ranks with hkv/u heads
    return dq + 2 * n * (hq * (m.d_qk + m.d_v)) * e + kv * (2 * e + 2 * 4) / max(u, 1)


def replay_workspace_bytes(m: ModelShape, s: int, par: Parallel, opt: MemoryOptions) -> float:
    """Transient attention bytes of a layer replayed in ``opt.recompute_tiles`` sequence tiles (backward).

    Pass 2 holds the whole sequence's K/V (gathered over CP; this rank's at CP = 1) in the activation
    dtype, their gradient sums in fp32 and one tile's fp32 dq (+ lse/delta).  At CP > 1 the reduce-scatter
    of pass 3 frees K/V first and then fills a send buffer as large as the fp32 dK/dV.
    """
    e, tiles = opt.bytes_per_element, opt.recompute_tiles
    n = par.micro_batch * s / par.cp
    hq, hkv = m.q_heads / par.tp, max(m.kv_heads / par.tp, 1)
    kv_all = par.cp * n * hkv * (m.d_qk + m.d_v)  # elements of the whole sequence's K and V
    dq = n / tiles * hq * (m.d_qk * 4 + 4)
    attend = kv_all * (e + 4) + dq
    if par.cp == 1:
        return attend
    return max(attend, kv_all * 2 * 4)


def _stage_activations(m: ModelShape, s: int, par: Parallel, opt: MemoryOptions, layers: int,
                       ) -> tuple[float, float, float, LayerActivations]:
    """(saved bytes of one micro-batch over ``layers`` layers, working set, host bytes per micro-batch, layer)."""
    e = opt.bytes_per_element
    moe_share = m.num_moe_layers / m.num_layers
    n_moe = layers * moe_share
    dense_layer = layer_activations(m, s, par, opt, moe_layer=False)
    moe_layer = layer_activations(m, s, par, opt, moe_layer=True) if m.num_moe_layers else dense_layer
    largest = moe_layer if m.num_moe_layers else dense_layer
    tiles = opt.tiled_mlp_tiles
    mlp_tile = largest.mlp / tiles
    saved = (layers - n_moe) * saved_per_layer(m, s, par, opt)
    if n_moe:
        saved += n_moe * saved_per_layer(m, s, par, opt, moe_layer=True)
    n = par.micro_batch * s / par.cp
    sp = par.tp if opt.sequence_parallel else 1
    layer_input = n * m.hidden_size * e / sp
    replay_tiles = opt.recompute_tiles
    if opt.recompute == "full":  # one layer recomputed during backward (TiledMLP: one tile of its MLP)
        working = largest.total - (largest.mlp if tiles > 1 else 0.0) + mlp_tile
        if replay_tiles > 1:  # replayed one sequence tile at a time: the layer's input and output gradients
            working = 2 * layer_input + working / replay_tiles
    else:
        working = mlp_tile  # backward holds the gradients of the MLP intermediates (one tile's worth)
    host = 0.0
    if opt.offload == "checkpoint":  # one being written, one prefetched (a tiled replay reads one tile back)
        host, saved = saved, layer_input + layer_input / replay_tiles
    elif opt.offload == "layers":
        host, saved = saved, 2 * saved / layers
    return saved, working, host, largest


def memory_breakdown(m: ModelShape, s: int, par: Parallel, opt: MemoryOptions, *,
                     reserved_gib: float = RESERVED_GIB) -> MemoryBreakdown:
    """Peak memory of one GPU training ``m`` on sequences of ``s`` tokens: the worse pipeline stage."""
    stages = ("first",) if par.pp == 1 else ("first", "last")
    return max((_stage_memory(m, s, par, opt, stage, reserved_gib) for stage in stages), key=lambda b: b.peak)


def _stage_memory(m: ModelShape, s: int, par: Parallel, opt: MemoryOptions, stage: str,
                  reserved_gib: float) -> MemoryBreakdown:
    e = opt.bytes_per_element
    check_recompute_tiles(m, par, opt)
    states = model_states(m, par, opt, stage)
    layers = -(-m.num_layers // par.pp)
    saved, working, act_host, largest = _stage_activations(m, s, par, opt, layers)
    # 1F1B: stage i holds pp - i micro-batches between their forward and backward; the last holds one.
    in_flight = par.in_flight if stage == "first" else 1
    n = par.micro_batch * s / par.cp
    sp = par.tp if opt.sequence_parallel else 1
    last = stage == "last" or par.pp == 1
    final = n * 2 * m.hidden_size * e / sp if last else 0.0  # final norm input and output
    if opt.offload != "none":  # host keeps every in-flight micro-batch; the GPU its two buffers
        activations = saved + final
    else:
        activations = in_flight * saved + final
    logits = n * m.vocab_size / par.tp * (2 * e + 4) / opt.tiled_loss_tiles if last else 0.0
    sp_gather = n * m.hidden_size * e if par.tp > 1 and opt.sequence_parallel else 0.0
    if opt.recompute_tiles > 1:
        workspace = replay_workspace_bytes(m, s, par, opt) + fa2_gqa_bytes(m, s, par, opt)
    else:
        workspace = attention_workspace_bytes(m, s, par, e) + fa2_gqa_bytes(m, s, par, opt)
    mask = par.micro_batch * float(s) * s if opt.dataloader_mask else 0.0
    streamed = state_offload(m, par, opt, stage)  # model-state offload's host and NVMe bytes
    host = in_flight * act_host + states.host + (streamed.host if streamed else 0.0)
    if opt.dataloader_mask:
        host += MASK_HOST_BYTES_PER_ELEMENT * par.micro_batch * float(s) * s
    return MemoryBreakdown(
        weights=states.weights, grads=states.grads, optimizer=states.optimizer, activations=activations,
        working=working, attention_workspace=workspace, sp_gather=sp_gather, logits=logits,
        dataloader_mask=mask, reserved=reserved_gib * GIB, host_offload=host, activation_host=act_host, stage=stage, per_layer=largest,
        grads_bf16=opt.main_grads_dtype == "bf16", disk_offload=streamed.disk if streamed else 0.0,
    )
