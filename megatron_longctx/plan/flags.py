"""The command-line flags of a plan: Megatron-LM's own and megatron-longctx's ``--longctx-*``.

Megatron's flags carry the model shape, the parallel layout (``--context-parallel-size``,
``--cp-comm-type``, ``--hierarchical-context-parallel-sizes``) and Megatron's own recompute
(``--recompute-*``).  The plugin's memory features come from :func:`longctx_options`, the one mapping
from a plan to :class:`megatron_longctx.config.LongContextConfig` fields; flag names and validation
come from the config dataclasses themselves.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megatron_longctx import cp_algorithms as algorithms
from megatron_longctx.config import (
    FEATURES,
    MEGATRON_FLAGS,
    LongContextConfig,
    flag_name,
)

from .model import GIB, ModelShape
from .search import Plan
from .state_offload import state_offload

# The planner's attention backends that name one of the plugin's kernels (auto: the plugin picks).
_KERNEL = {"flash_attn2": "flash_attn", "flash_attn3": "flash_attn", "sdpa_cuda": "sdpa_cuda"}
HOST_POOL_MARGIN = 1.1
MODEL_STATE_FIELD = "model_state_offload"  # --longctx-model-state-offload host|disk


def longctx_options(plan: Plan) -> dict[str, Any]:
    """``{LongContextConfig field: value}`` for the plugin's features this plan turns on."""
    opt, par = plan.options, plan.parallel
    out: dict[str, Any] = {}
    if par.cp > 1 and opt.attention_backend != "te_cudnn":  # te_cudnn: Megatron's own TE attention and CP
        out["cp_algorithm"] = algorithms.for_cp_comm_type(par.cp_comm_type).name
    if opt.attention_backend in _KERNEL:
        out["cp_kernel_backend"] = _KERNEL[opt.attention_backend]
    if opt.offload == "checkpoint":  # the plugin's full recompute owns the checkpoints it offloads
        out.update(recompute_granularity="full", offload_policy="checkpoint")
    elif opt.offload == "layers":
        out.update(offload_policy="layers", offload_num_layers=0)
    if opt.recompute_tiles > 1:  # the plugin runs the full recompute it replays in tiles (all-gather CP above)
        out.update(recompute_granularity="full", recompute_tiles=opt.recompute_tiles)
    so = state_offload(plan.model, par, opt, plan.memory.stage)
    if opt.offload != "none" or so is not None:  # every micro-batch in flight on the first pipeline stage
        pinned = plan.memory.activation_host * plan.parallel.in_flight if opt.offload != "none" else 0.0
        pinned += so.pinned if so is not None else 0.0  # model states share the pool's bound
        out["offload_host_pool_bytes"] = int(math.ceil(pinned * HOST_POOL_MARGIN / GIB)) * GIB
    if so is not None and _config_has(MODEL_STATE_FIELD):
        out[MODEL_STATE_FIELD] = so.target
    if opt.tiled_mlp_tiles > 1:
        out["tiled_mlp_tiles"] = opt.tiled_mlp_tiles
    if opt.tiled_loss_tiles > 1:
        out["tiled_loss_tiles"] = opt.tiled_loss_tiles
    LongContextConfig.from_flat(out)  # validates names, values and combinations (raises ValueError)
    return out


def _config_has(name: str) -> bool:
    return name in _defaults()


def _defaults() -> dict[str, Any]:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for _, cls in FEATURES for f in dataclasses.fields(cls)}


def longctx_flags(plan: Plan) -> list[str]:
    """``--longctx-*`` flags for the values of :func:`longctx_options` that differ from the defaults."""
    defaults, argv = _defaults(), []
    for name, value in longctx_options(plan).items():
        if value == defaults.get(name) or name in MEGATRON_FLAGS:  # given as Megatron's own flag
            continue
        if isinstance(value, bool):  # argparse.BooleanOptionalAction: --longctx-x / --no-longctx-x
            argv.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        elif isinstance(value, (tuple, list)):
            argv += [flag_name(name), *map(str, value)]
        else:
            argv += [flag_name(name), str(value)]
    target = plan.options.model_state_offload
    if target and not _config_has(MODEL_STATE_FIELD):  # the config section comes with the weight streaming
        argv += ["--longctx-" + MODEL_STATE_FIELD.replace("_", "-"), target]
    return argv


def model_flags(m: ModelShape) -> list[str]:
    """Megatron-LM flags of the model shape."""
    argv = ["--num-layers", m.num_layers, "--hidden-size", m.hidden_size, "--ffn-hidden-size", m.ffn_hidden_size,
            "--num-attention-heads", m.num_attention_heads, "--normalization", m.normalization,
            *(() if m.add_bias_linear else ("--disable-bias-linear",)), "--attention-dropout", "0.0",
            "--hidden-dropout", "0.0"]
    if m.multi_latent_attention:
        argv += ["--multi-latent-attention", "--kv-lora-rank", m.kv_lora_rank, "--qk-head-dim", m.qk_head_dim,
                 "--qk-pos-emb-head-dim", m.qk_pos_emb_head_dim, "--v-head-dim", m.v_head_dim]
        if m.q_lora_rank is not None:
            argv += ["--q-lora-rank", m.q_lora_rank]
    else:
        argv += ["--kv-channels", m.kv_channels]
        if m.num_query_groups != m.num_attention_heads:
            argv += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    if m.activation == "swiglu":
        argv.append("--swiglu")
    if m.rope:
        argv += ["--position-embedding-type", "rope", "--rotary-base", m.rotary_base]
    if m.untie_embeddings:
        argv.append("--untie-embeddings-and-output-weights")
    if m.num_experts is not None:
        argv += ["--num-experts", m.num_experts, "--moe-router-topk", m.moe_router_topk,
                 "--moe-ffn-hidden-size", m.moe_ffn_hidden_size, "--moe-token-dispatcher-type", "alltoall"]
        if m.moe_shared_expert_intermediate_size:
            argv += ["--moe-shared-expert-intermediate-size", m.moe_shared_expert_intermediate_size]
        if m.moe_first_dense_layers:
            pattern = f"([0]*{m.moe_first_dense_layers}+[1]*{m.num_layers - m.moe_first_dense_layers})"
            argv += ["--moe-layer-freq", pattern]
    return [str(a) for a in argv]


def megatron_flags(plan: Plan) -> list[str]:
    """Megatron-LM flags: model shape, sequence, batch, parallel layout, precision, Megatron recompute."""
    par, opt = plan.parallel, plan.options
    argv = model_flags(plan.model) + [
        "--seq-length", plan.seq_length, "--max-position-embeddings", plan.seq_length,
        "--micro-batch-size", par.micro_batch, "--global-batch-size", plan.global_batch_size,
        "--tensor-model-parallel-size", par.tp, "--context-parallel-size", par.cp,
    ]
    if par.pp > 1:
        argv += ["--pipeline-model-parallel-size", par.pp]
    argv.append("--bf16")
    if opt.fsdp:  # Megatron-FSDP shards weights, grads and optimizer (ZeRO-3)
        argv += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                 "--overlap-grad-reduce", "--overlap-param-gather"]
    elif opt.model_state_offload:  # the streamer reduces each layer's gradients itself, as its backward ends
        argv += ["--use-distributed-optimizer", "--no-gradient-accumulation-fusion"]
    else:
        argv += ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
    if opt.fp8:
        argv += ["--fp8-format", "hybrid"]
    if not opt.dataloader_mask:  # the plugin's attention is causal by itself: no dense [s, s] mask
        argv.append("--no-create-attention-mask-in-dataloader")
    if par.tp > 1 and opt.sequence_parallel:
        argv.append("--sequence-parallel")
    if par.cp > 1:
        argv += ["--cp-comm-type", par.cp_comm_type]
        if par.cp_comm_type == "a2a+p2p":
            argv += ["--hierarchical-context-parallel-sizes", par.ulysses_size, par.cp // par.ulysses_size]
    if par.ep > 1:
        argv += ["--expert-model-parallel-size", par.ep]
    # Checkpoint offload and the tiled replay ride on full recompute (the plugin then runs it).
    if opt.recompute == "full" or opt.offload == "checkpoint":
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", 1]
    elif opt.recompute == "selective":
        argv += ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    precision_aware = opt.optimizer_offload or opt.main_grads_dtype == "bf16"
    if opt.optimizer_offload:
        argv += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0"]
    if precision_aware:
        argv.append("--use-precision-aware-optimizer")
    if opt.main_grads_dtype == "bf16":
        argv += ["--main-grads-dtype", "bf16"]
    return [str(a) for a in argv]


def all_flags(plan: Plan) -> list[str]:
    return megatron_flags(plan) + longctx_flags(plan)
