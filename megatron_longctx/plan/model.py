"""The model shape, the memory options and the activations one layer saves, per GPU.

Activation bytes follow Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198): a GPT-3-style layer (MHA, GELU MLP of 4h, dropout, flash attention) saves
34·s·b·h bytes in 16-bit, divided by TP under sequence parallelism.  Here the same count is written
per saved tensor so that it covers GQA, RoPE, SwiGLU, MoE, MLA and Megatron's local (unfused)
attention, which also keeps the ``[b, h, s, s]`` probabilities.  Context parallelism divides the
tokens of every term.  Model states are in :mod:`.states`, the peak per GPU in :mod:`.memory`.

All sizes are bytes unless a name says otherwise; ``s`` is the global sequence length, ``b`` the
micro-batch, ``tp``/``cp`` the parallel sizes, ``e`` bytes per activation element.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

GIB = 1 << 30
_TOKEN_UNITS = {"K": 1 << 10, "M": 1 << 20}


def parse_tokens(text: str) -> int:
    """A token count as users write one: ``131072``, ``128K``/``128k`` (×1024), ``1M`` or ``1.5M`` (×1024²);
    ``ValueError`` unless it is a whole number of tokens (the caller checks its range)."""
    t = text.strip().upper()
    scale = _TOKEN_UNITS.get(t[-1:], 1)
    number = float(t[:-1] if scale > 1 else t)  # ValueError for anything else
    value = number * scale
    if not value.is_integer() or "E" in t or "N" in t:  # no 1e3, nan or inf spellings
        raise ValueError(text)
    return int(value)
ATTENTION_IMPLS = ("flash", "local")
RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "checkpoint", "layers")
ACTIVATIONS = ("swiglu", "gelu")
GRAD_DTYPES = ("fp32", "bf16")
# Megatron's HybridDeviceOptimizer (--optimizer-cpu-offload, megatron/core/optimizer/cpu_offloading/
# hybrid_optimizer.py) keeps per offloaded parameter: a pinned fp32 copy of the parameter (the master),
# a pinned fp32 copy of its gradient (cpu_copy_map_grad) and torch Adam's exp_avg and exp_avg_sq (fp32).
OPTIMIZER_HOST_BYTES_PER_PARAM = 16
# Model-state offload (--longctx-model-state-offload, docs/model-state-offload.md): per parameter, off the GPU.
MODEL_STATE_TARGETS = ("host", "disk")
WEIGHT_BYTES = 2  # bf16 weights (the off-device copy the layers stream from)
MASTER_BYTES = 4  # fp32 master weights (Megatron's mixed-precision optimizer's copies)
MOMENT_BYTES = 8  # AdamW's exp_avg and exp_avg_sq, fp32 (host memory, or the moments file on disk)
# TE's FP8 GEMMs cache an FP8 copy of each weight and, on Hopper, its transpose (1 byte each).
FP8_WEIGHT_CACHE_BYTES = 2


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer as Megatron-Core builds it (flag names in the comments)."""

    name: str
    num_layers: int  # --num-layers
    hidden_size: int  # --hidden-size
    num_attention_heads: int  # --num-attention-heads
    num_query_groups: int  # --num-query-groups (= heads for MHA)
    kv_channels: int  # --kv-channels (head dim)
    ffn_hidden_size: int  # --ffn-hidden-size (dense layers)
    vocab_size: int  # --vocab-size (padded)
    activation: str = "swiglu"  # swiglu (--swiglu) | gelu
    normalization: str = "RMSNorm"  # RMSNorm | LayerNorm
    rope: bool = True  # --position-embedding-type rope
    rotary_base: int = 10000
    untie_embeddings: bool = True  # --untie-embeddings-and-output-weights
    add_bias_linear: bool = False  # biases on the linear layers (Megatron's default); False: --disable-bias-linear
    # Mixture of experts (--num-experts ...); None = dense.
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 0
    moe_shared_expert_intermediate_size: int = 0
    moe_first_dense_layers: int = 0  # DeepSeek's first_k_dense_replace
    # Multi-latent attention (DeepSeek-V2, arXiv:2405.04434).
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                     "ffn_hidden_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}: got {getattr(self, name)}; give a positive integer")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"--num-query-groups {self.num_query_groups} must divide --num-attention-heads "
                             f"{self.num_attention_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: choose one of {ACTIVATIONS}")
        if self.num_experts is not None and (self.moe_ffn_hidden_size <= 0 or self.moe_router_topk <= 0):
            raise ValueError("--num-experts needs --moe-ffn-hidden-size > 0 and --moe-router-topk > 0")
        if self.add_bias_linear and (self.num_experts is not None or self.multi_latent_attention):
            raise ValueError(f"{self.name}: linear biases are modelled for dense attention and MLPs only; "
                             "give an MoE or MLA model --disable-bias-linear (add_bias_linear=False)")

    # Head geometry: what attention sees per token.
    @property
    def q_heads(self) -> int:
        return self.num_attention_heads

    @property
    def kv_heads(self) -> int:
        """Heads of K/V as attention receives them (MLA up-projects K/V to every query head)."""
        return self.num_attention_heads if self.multi_latent_attention else self.num_query_groups

    @property
    def d_qk(self) -> int:
        return self.qk_head_dim + self.qk_pos_emb_head_dim if self.multi_latent_attention else self.kv_channels

    @property
    def d_v(self) -> int:
        return self.v_head_dim if self.multi_latent_attention else self.kv_channels

    @property
    def num_moe_layers(self) -> int:
        return 0 if self.num_experts is None else self.num_layers - self.moe_first_dense_layers

    @property
    def glu(self) -> int:
        """FC1 width multiplier: 2 for gated (SwiGLU) MLPs."""
        return 2 if self.activation == "swiglu" else 1


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    attention: int  # per layer
    dense_mlp: int  # per dense layer
    moe_routed: int  # per MoE layer, all experts
    moe_active: int  # per MoE layer, the experts one token uses (+ router, shared experts)
    moe_shared: int  # per MoE layer: shared experts (TP-sharded like a dense MLP)
    moe_router: int  # per MoE layer: router (replicated on every TP rank)
    norms: int  # per layer
    embedding: int  # input embedding (+ output layer when untied)
    total: int
    active: int  # per-token active parameters (MoE: top-k experts)


def param_counts(m: ModelShape) -> ParamCounts:
    """Parameter counts as Megatron builds the model (linear biases only with ``add_bias_linear``)."""
    h = m.hidden_size
    if m.multi_latent_attention:
        hq = m.num_attention_heads
        q = h * hq * m.d_qk if m.q_lora_rank is None else m.q_lora_rank * (h + hq * m.d_qk + 1)
        kv = m.kv_lora_rank * (h + hq * (m.qk_head_dim + m.v_head_dim) + 1) + h * m.qk_pos_emb_head_dim
        attention = q + kv + hq * m.v_head_dim * h
    else:
        attention = h * m.kv_channels * (2 * m.num_attention_heads + 2 * m.num_query_groups)
    dense_mlp = (m.glu + 1) * h * m.ffn_hidden_size
    if m.add_bias_linear:  # QKV and projection outputs; FC1 (gate and up under SwiGLU) and FC2 outputs
        attention += (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels + h
        dense_mlp += m.glu * m.ffn_hidden_size + h
    norm = h if m.normalization == "RMSNorm" else 2 * h
    norms = 2 * norm
    if m.num_experts is not None:
        per_expert = (m.glu + 1) * h * m.moe_ffn_hidden_size
        shared = (m.glu + 1) * h * m.moe_shared_expert_intermediate_size
        router = h * m.num_experts
        moe_routed, moe_shared, moe_router = per_expert * m.num_experts, shared, router
        moe_active = per_expert * m.moe_router_topk + shared + router
    else:
        moe_routed = moe_active = moe_shared = moe_router = 0
    embedding = m.vocab_size * h * (2 if m.untie_embeddings else 1)
    n_dense = m.num_layers - m.num_moe_layers
    base = m.num_layers * (attention + norms) + norm + embedding + n_dense * dense_mlp
    total = base + m.num_moe_layers * (moe_routed + moe_shared + moe_router)
    active = base + m.num_moe_layers * moe_active
    return ParamCounts(attention, dense_mlp, moe_routed, moe_active, moe_shared, moe_router, norms, embedding, total,
                       active)


@dataclasses.dataclass(frozen=True)
class Parallel:
    """How the job is split: sizes and the CP algorithm (Megatron's ``--cp-comm-type`` names)."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallel (MoE), carved out of dp × cp as in Megatron
    cp_comm_type: str = "p2p"  # p2p | all_gather | a2a | a2a+p2p
    ulysses_size: int = 1  # a2a+p2p: size of the all-to-all sub-group (first hierarchical size)
    micro_batch: int = 1
    pp: int = 1  # --pipeline-model-parallel-size (1F1B schedule)
    micro_batches: int = 1  # per step and data-parallel rank: global batch / (micro batch × dp)

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "dp", "ep", "ulysses_size", "micro_batch", "pp", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"Parallel.{name} = {getattr(self, name)}: must be >= 1")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def in_flight(self) -> int:
        """Micro-batches whose activations the first pipeline stage holds at once under 1F1B."""
        return min(self.pp, self.micro_batches)


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """Activation-memory settings (Megatron's ``--recompute-*`` and ``--longctx-*`` memory features)."""

    attention_impl: str = "flash"  # flash: saves q, k, v, out, lse | local: also the [b, h, s, s] probs
    recompute: str = "none"  # none | selective (core_attn) | full (every layer, uniform)
    offload: str = "none"  # none | checkpoint (layer inputs under full recompute) | layers (all saved tensors)
    tiled_mlp_tiles: int = 1
    tiled_loss_tiles: int = 1
    recompute_tiles: int = 1  # full recompute replayed in this many sequence tiles (--longctx-recompute-tiles)
    optimizer_offload: bool = False  # Megatron's --optimizer-cpu-offload: master weights + Adam moments on host
    bytes_per_element: int = 2
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    fused_swiglu: bool = True  # Megatron's bias_swiglu fusion saves only FC1's output
    fused_rope: bool = True  # TE's fused RoPE; the unfused one keeps cos/sin [s, 1, 1, d] per use
    dropout_mask_bytes: int = 1  # CUDA's fused dropout keeps a bool mask; the CPU keeps a noise tensor (e)
    sequence_parallel: bool = True  # with TP > 1
    main_grads_dtype: str = "fp32"  # Megatron's --main-grads-dtype (bf16 needs --use-precision-aware-optimizer)
    fsdp: bool = False  # Megatron-FSDP (--use-megatron-fsdp, optim_grads_params): weights and grads sharded too
    fp8: bool = False  # FP8 GEMMs through Transformer Engine (--fp8-format hybrid)
    attention_backend: str = "auto"  # the attention kernel (efficiency.ATTENTION_BACKENDS)
    dataloader_mask: bool = False  # Megatron's --create-attention-mask-in-dataloader (dense [b, 1, s, s])
    model_state_offload: Optional[str] = None  # --longctx-model-state-offload host|disk (None: off)

    def __post_init__(self) -> None:
        from .efficiency import ATTENTION_BACKENDS

        if self.main_grads_dtype not in GRAD_DTYPES:
            raise ValueError(f"--main-grads-dtype {self.main_grads_dtype!r}: choose one of {', '.join(GRAD_DTYPES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend {self.attention_backend!r}: choose one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        if self.model_state_offload not in (None, *MODEL_STATE_TARGETS):
            raise ValueError(f"--model-state-offload {self.model_state_offload!r}: choose one of "
                             f"{', '.join(MODEL_STATE_TARGETS)}")
        if self.model_state_offload and self.fsdp:
            raise ValueError("--model-state-offload streams whole layers from host memory; it does not combine "
                             "with --megatron-fsdp (drop one)")
        if self.model_state_offload and self.optimizer_offload:
            raise ValueError("--model-state-offload runs its own AdamW off the device: drop --optimizer-offload "
                             "(Megatron's --optimizer-cpu-offload)")
        for name, allowed in (("attention_impl", ATTENTION_IMPLS), ("recompute", RECOMPUTE), ("offload", OFFLOAD)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {', '.join(allowed)}")
        if self.offload == "checkpoint" and self.recompute != "full":
            raise ValueError("offload='checkpoint' moves the inputs that full recompute keeps; set recompute='full'")
        if self.tiled_mlp_tiles < 1 or self.tiled_loss_tiles < 1:
            raise ValueError("tiled_mlp_tiles and tiled_loss_tiles must be >= 1 (1 = off)")
        if isinstance(self.recompute_tiles, bool) or not isinstance(self.recompute_tiles, int) \
                or self.recompute_tiles < 1:
            raise ValueError(f"--recompute-tiles {self.recompute_tiles!r}: give an integer >= 1 (1 = off)")
        if self.recompute_tiles > 1:
            self._check_recompute_tiles()

    def _check_recompute_tiles(self) -> None:
        """What a layer replayed in sequence tiles refuses (megatron_longctx.memory.tiled_recompute)."""
        n = self.recompute_tiles
        if self.recompute != "full":
            raise ValueError(f"--recompute-tiles {n} replays the layers of full recompute in tiles, but recompute="
                             f"{self.recompute!r}: add --recompute full (Megatron's --recompute-granularity full), "
                             "or set --recompute-tiles 1")
        if self.attention_dropout > 0 or self.hidden_dropout > 0:
            raise ValueError(f"--recompute-tiles {n}: dropout would draw other masks per tile; set "
                             "--attention-dropout 0 and --hidden-dropout 0, or set --recompute-tiles 1")
        if self.attention_impl != "flash":
            raise ValueError(f"--recompute-tiles {n}: the tiles attend through megatron_longctx's core attention, "
                             f"not Megatron's {self.attention_impl!r} one; use attention_impl='flash', or set "
                             "--recompute-tiles 1")
        if self.attention_backend == "te_cudnn":
            raise ValueError(f"--recompute-tiles {n}: te_cudnn is Megatron's own TE attention, which cannot attend "
                             "one tile over gathered K/V; choose another --attention-backend, or set "
                             "--recompute-tiles 1")


@dataclasses.dataclass(frozen=True)
class LayerActivations:
    """Bytes one transformer layer keeps for backward on one GPU, by part (no recompute)."""

    norms: float  # both norms' inputs + statistics, and their outputs (saved by QKV / FC1)
    attention: float  # q, k, v (+ the QKV buffer a V view keeps alive), out, lse
    scores: float  # local attention only: softmax probs (+ dropout mask, dropped probs)
    mlp: float  # FC1 output, activation output (MoE: permuted tokens and expert intermediates)
    dropout_masks: float  # hidden dropout masks after attention and MLP

    @property
    def total(self) -> float:
        return self.norms + self.attention + self.scores + self.mlp + self.dropout_masks


def _attention_elems_per_token(m: ModelShape, impl: str) -> float:
    """Elements of q/k/v/out that attention keeps per token (all heads, before TP division)."""
    hq, hkv = m.q_heads, m.kv_heads
    if m.multi_latent_attention:
        q_lora = 0 if m.q_lora_rank is None else 2 * m.q_lora_rank
        latents = 2 * m.kv_lora_rank + m.qk_pos_emb_head_dim + q_lora  # down-projections and their norms
        kv_up = hq * (m.qk_head_dim + m.v_head_dim)  # kept alive by the V view
        return latents + kv_up + 2 * hq * m.d_qk + 2 * hq * m.d_v
    d = m.kv_channels
    qkv_buffer = (hq + 2 * hkv) * d  # one linear_qkv output; q/k/v start as views of it
    out = hq * d
    if impl == "local" and hq > hkv:
        # repeat_interleave expands K and V to every query head (new tensors); q is new under RoPE.
        q = hq * d if m.rope else qkv_buffer
        return q + 2 * hq * d + out
    # V stays a view of the QKV buffer; RoPE writes q and k into new tensors.
    rope = (hq + hkv) * d if m.rope else 0
    return qkv_buffer + rope + out


def layer_activations(m: ModelShape, s: int, par: Parallel, opt: MemoryOptions, moe_layer: bool = False,
                      ) -> LayerActivations:
    """Bytes saved for backward by one layer on one GPU without recompute (tokens ``b·s/cp``, TP-sharded).

    Korthikanti et al. Table 2 per tensor: LN inputs 2sbh·2, QKV input, Q/K/V, attention out, MLP
    FC1 output and activation output, dropout masks (1 byte).  Local attention adds the probabilities
    ``b·hq·s²`` (plus mask and dropped copy under attention dropout).
    """
    if opt.attention_impl == "local" and par.cp > 1:
        raise ValueError("Megatron's local attention does not support context parallelism; use attention_impl="
                         "'flash' (TE or megatron_longctx) with --context-parallel-size > 1")
    e, t, h = opt.bytes_per_element, par.tp, m.hidden_size
    n = par.micro_batch * s / par.cp  # tokens on this GPU
    sp = t if opt.sequence_parallel else 1  # sequence parallel shards what lies outside attention and MLP
    stats = 4 if m.normalization == "RMSNorm" else 8  # fp32 rstd (and mean for LayerNorm) per token
    norms = n * 2 * (2 * h * e + stats) / sp
    attn = n * _attention_elems_per_token(m, opt.attention_impl) * e / t
    scores = 0.0
    if opt.attention_impl == "flash":
        attn += n * m.q_heads * 4 / t  # fp32 log-sum-exp per query head
    if m.rope and not opt.fused_rope:
        attn += 4 * s / par.cp * m.d_qk * e  # unfused RoPE keeps cos and sin [s, 1, 1, d] for q and for k
    if opt.attention_impl == "local" and opt.recompute != "selective":  # selective: core_attn is recomputed
        probs = par.micro_batch * m.q_heads * float(s) * s / t
        scores = probs * e + (probs * (opt.dropout_mask_bytes + e) if opt.attention_dropout > 0 else 0.0)
    if moe_layer:
        f, k = m.moe_ffn_hidden_size, m.moe_router_topk
        act = (m.glu + 1) * f if (m.activation == "gelu" or opt.fused_swiglu) else 2 * m.glu * f
        routed = k * (2 * h + act)  # permuted input + unpermute input per copy, FC1 out, activation out
        fs = m.moe_shared_expert_intermediate_size
        shared = ((m.glu + 1) * fs if opt.fused_swiglu else 2 * m.glu * fs) if fs else 0
        router = m.num_experts * 3 * 4 / e  # fp32 logits, probs, routing map
        mlp = n * (routed + shared + router) * e / t
    else:
        f = m.ffn_hidden_size
        act = (m.glu + 1) * f if (m.activation == "gelu" or opt.fused_swiglu) else 2 * m.glu * f
        mlp = n * act * e / t
    masks = n * 2 * h * opt.dropout_mask_bytes / sp if opt.hidden_dropout > 0 else 0.0
    return LayerActivations(norms, attn, scores, mlp, masks)


def check_recompute_tiles(m: ModelShape, par: Parallel, opt: MemoryOptions) -> None:
    """The parallel layout and model that a layer replay in sequence tiles refuses (``ValueError``).

    The refusals of ``megatron_longctx.megatron.arguments._check_recompute_tiles`` and
    ``memory_spec._check_tiled_replay``: CP > 1 needs the all-gather algorithm (K/V gathered once per
    layer); sequence parallelism (TP > 1) and MoE layers are not cut per tile.
    """
    n = opt.recompute_tiles
    if n <= 1:
        return
    if par.cp > 1 and par.cp_comm_type != "all_gather":
        raise ValueError(f"--recompute-tiles {n}: a layer replayed in tiles gathers K/V once over the CP group, "
                         f"but --cp-comm-type is {par.cp_comm_type!r}: use --cp-comm-type all_gather "
                         "(--longctx-cp-algorithm allgather), or set --recompute-tiles 1")
    if par.tp > 1 and opt.sequence_parallel:
        raise ValueError(f"--recompute-tiles {n}: with sequence parallelism each rank's hidden states are a slice "
                         "of the sequence the layer gathers itself; drop --sequence-parallel "
                         "(sequence_parallel=False), use --tp 1, or set --recompute-tiles 1")
    if m.num_experts is not None:
        raise ValueError(f"--recompute-tiles {n}: MoE layers route tokens over the whole sequence, not per tile; "
                         "set --recompute-tiles 1 for a model with --num-experts")


def korthikanti_layer_bytes(s: int, b: int, h: int, heads: int, tp: int = 1, flash: bool = True) -> float:
    """Korthikanti et al. eq. for a GPT-3 layer in 16-bit with sequence parallelism.

    ``s·b·h·(34 + 5·a·s/h)/t``; with flash attention the ``5·a·s/h`` term (probabilities, mask) vanishes.
    """
    return s * b * h * (34 + (0 if flash else 5 * heads * s / h)) / tp
