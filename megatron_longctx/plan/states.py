"""Model states of one GPU: bf16 weights, main gradients, optimizer states, and what goes to the host.

Megatron-Core's choices, each with its bytes per parameter of this GPU's pipeline stage and TP shard:

* distributed optimizer (``--use-distributed-optimizer``, ZeRO-1, arXiv:1910.02054): bf16 weights (2)
  and main gradients (4 fp32, or 2 with ``--main-grads-dtype bf16``) on every rank, fp32 master weights
  and the two Adam moments (12) sharded over data × context parallel;
* ``--optimizer-cpu-offload``: those 12 move to the host, where the hybrid optimizer also keeps a pinned
  fp32 gradient copy: 16 bytes per parameter of the shard (:data:`.model.OPTIMIZER_HOST_BYTES_PER_PARAM`);
* Megatron-FSDP (``--use-megatron-fsdp``, ``optim_grads_params``, ZeRO-3): weights and gradients sharded
  too, with the current and the prefetched layer unsharded;
* FP8 GEMMs (TE): an FP8 copy of every layer weight and its transpose (2 bytes);
* model-state offload (``--longctx-model-state-offload host|disk``, :mod:`.state_offload`): bf16 weights
  stream in one layer at a time from host memory or NVMe, gradients stream out and accumulate on the
  host, the optimizer runs on the CPU; the GPU keeps two slots of each (in use and in flight).
"""

from __future__ import annotations

import dataclasses
import math

from .model import (
    FP8_WEIGHT_CACHE_BYTES, OPTIMIZER_HOST_BYTES_PER_PARAM, MemoryOptions, ModelShape, Parallel, param_counts,
)


@dataclasses.dataclass(frozen=True)
class StageParams:
    """Parameters on one GPU of one pipeline stage (after TP and EP sharding)."""

    layers: int  # transformer layers on the stage
    dense: float  # TP-sharded + replicated dense parameters, embeddings included
    experts: float  # routed-expert parameters (sharded over EP × TP)
    layer_gemm: float  # GEMM weights of the stage's layers (FP8 candidates)
    largest_unit: float  # the largest block streamed at once: one layer or one embedding matrix

    @property
    def total(self) -> float:
        return self.dense + self.experts


def stage_params(m: ModelShape, par: Parallel, stage: str = "first") -> StageParams:
    """Parameters of the ``first`` or ``last`` pipeline stage (the same stage when PP = 1)."""
    p = param_counts(m)
    layers = math.ceil(m.num_layers / par.pp)
    moe_share = m.num_moe_layers / m.num_layers
    n_moe = layers * moe_share
    attn = layers * p.attention / par.tp
    mlp = (layers - n_moe) * p.dense_mlp / par.tp + n_moe * (p.moe_shared / par.tp + p.moe_router)
    norms = layers * p.norms
    experts = n_moe * p.moe_routed / (par.ep * par.tp)
    matrix = m.vocab_size * m.hidden_size / par.tp
    first, last = stage == "first" or par.pp == 1, stage == "last" or par.pp == 1
    embed = (matrix if first else 0.0) + (matrix if last and m.untie_embeddings else 0.0)
    embed += matrix if last and not first and not m.untie_embeddings else 0.0  # tied: last stage keeps a copy
    final_norm = m.hidden_size * (1 if m.normalization == "RMSNorm" else 2) if last else 0.0
    per_layer = (p.attention + (p.dense_mlp if m.num_experts is None else p.moe_routed / par.ep)) / par.tp
    return StageParams(layers, attn + mlp + norms + embed + final_norm, experts, attn + mlp + experts,
                       max(per_layer, matrix))


SLOTS = 2  # model-state offload's device slots per streamed kind: the block in use and the one in flight


@dataclasses.dataclass(frozen=True)
class ModelStates:
    weights: float
    grads: float
    optimizer: float
    host: float  # bytes of model states in host memory for this GPU


def model_states(m: ModelShape, par: Parallel, opt: MemoryOptions, stage: str = "first") -> ModelStates:
    """Bytes of weights, main grads and optimizer states one GPU of ``stage`` holds, and the host's share."""
    sp = stage_params(m, par, stage)
    g = 4 if opt.main_grads_dtype == "fp32" else 2
    shard = max(par.dp * par.cp, 1)
    expert_shard = max(par.dp * par.cp // par.ep, 1)
    sharded = sp.dense / shard + sp.experts / expert_shard  # this GPU's optimizer shard (parameters)
    fp8 = FP8_WEIGHT_CACHE_BYTES * sp.layer_gemm if opt.fp8 else 0.0
    if opt.model_state_offload:
        # Two blocks resident (in use + in flight) for the weights and for the gradients on their way out.
        weights = SLOTS * 2 * sp.largest_unit + (SLOTS * FP8_WEIGHT_CACHE_BYTES * sp.largest_unit if opt.fp8 else 0.0)
        grads = SLOTS * g * sp.largest_unit
        return ModelStates(weights, grads, 0.0, 0.0)  # the host's and disk's share: .state_offload
    if opt.fsdp:
        unsharded = 2 * sp.largest_unit  # current layer and the prefetched one, gathered
        weights = 2 * sharded + 2 * unsharded + fp8
        grads = g * sharded + g * unsharded  # the layer's full gradient before its reduce-scatter
    else:
        weights, grads = 2 * sp.total + fp8, g * sp.total
    optimizer = 12 * sharded
    host = 0.0
    if opt.optimizer_offload:
        host, optimizer = OPTIMIZER_HOST_BYTES_PER_PARAM * sharded, 0.0
    return ModelStates(weights, grads, optimizer, host)
