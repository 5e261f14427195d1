"""Recompute (selective and full, and the full recompute replayed in sequence tiles) and the one wrapper
per transformer layer.

Selective recompute wraps named submodules (innermost: it changes what a module saves).  Every layer
gets one wrapper, outermost, in this order from the outside in: layer scope, offload packer,
discard-output packer, full-recompute checkpoint.  The offload packer sits outside the checkpoint so it
sees exactly what a recomputed layer keeps, its inputs (ALST checkpoint offload); the discard packer sits
inside the offload packer so a norm output is recomputed rather than offloaded.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Any, Callable, Optional

import torch

from megatron_longctx.config import LongContextConfig
from megatron_longctx.megatron.features.base import Built, Feature, Installed
from megatron_longctx.megatron.features.offload import offloader_of, residual_grad_target
from megatron_longctx.megatron.nvtx import NvtxRanges
from megatron_longctx.memory import hooks, residual_offload
from megatron_longctx.memory.offload import ActivationOffloader
from megatron_longctx.memory.recompute import (
    DiscardOutputPacker,
    apply_selective_recompute,
    checkpoint,
    full_recompute_layers,
)
from megatron_longctx.memory.tiled_recompute import replay_port_of, tiled_checkpoint
from megatron_longctx.patching import patch

_MEGATRON_RECOMPUTE = ("recompute_granularity", "recompute_method", "recompute_num_layers")


def check_tiled_replay(config: Any) -> None:
    """What a layer replayed in sequence tiles cannot serve, each refused with the flag to change."""
    fix = "or set --longctx-recompute-tiles 0"
    if getattr(config, "hidden_dropout", 0.0) or getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"--longctx-recompute-tiles: dropout would draw other masks per tile; set --hidden-dropout 0 "
                         f"and --attention-dropout 0, {fix}")
    if getattr(config, "sequence_parallel", False):
        raise ValueError(f"--longctx-recompute-tiles: with --sequence-parallel each rank's hidden states are a "
                         f"slice of the sequence that the layer gathers itself; drop --sequence-parallel, {fix}")
    if getattr(config, "num_moe_experts", None):
        raise ValueError(f"--longctx-recompute-tiles: MoE layers route tokens (and balance the load) over the "
                         f"whole sequence, not per tile; drop --num-experts, {fix}")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What one layer's wrapper does (the bundle :func:`wrap_layer` reads)."""

    index: int
    first: bool  # the first layer of a model chunk: a new micro-batch starts here
    recompute: bool
    tiles: int  # > 1: the recompute replays the layer in this many sequence tiles
    output_over_input: bool
    offload_here: bool
    offloader: Optional[ActivationOffloader]
    discard: Optional[DiscardOutputPacker]
    grad_target: Optional[residual_offload.Target]


def wrap_layer(layer: torch.nn.Module, plan: LayerPlan) -> Callable[[], None]:
    original = layer.forward
    offloader, discard = plan.offloader, plan.discard
    tiled = plan.recompute and plan.tiles > 1
    port = replay_port_of(layer) if tiled else None

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if plan.first and offloader is not None and torch.is_grad_enabled():
            offloader.next_microbatch()
        with contextlib.ExitStack() as stack:
            stack.enter_context(hooks.layer_scope(plan.index))
            if plan.offload_here:
                stack.enter_context(hooks.packing(offloader))
            if discard is not None:
                stack.enter_context(hooks.packing(discard))
            try:
                if tiled:
                    return tiled_checkpoint(original, plan.tiles, layer.parameters, *args, port=port,
                                            grad_target=plan.grad_target, output_over_input=plan.output_over_input,
                                            ranges=NvtxRanges(), **kwargs)
                return checkpoint(original, *args, **kwargs) if plan.recompute else original(*args, **kwargs)
            finally:
                if discard is not None:
                    discard.clear()

    what = "recompute" if plan.recompute else "offload"
    return patch(layer, "forward", forward, f"layer {plan.index}: {what} of its saved tensors").undo


def _refuse_intermediate_outputs(decoder: torch.nn.Module) -> Callable[[], None]:
    """A decoder forward asked for its layers' hidden states (``extract_layer_indices``) is an error while
    layers write their outputs over their inputs: those tensors would hold later layers' values."""
    original = decoder.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("extract_layer_indices"):
            raise ValueError("--longctx-tiled-output-over-input: the decoder was asked for intermediate hidden "
                             "states (extract_layer_indices), which the next layer overwrites; drop the flag for "
                             "this model")
        return original(*args, **kwargs)

    return patch(decoder, "forward", forward, "--longctx-tiled-output-over-input: refuses intermediate outputs").undo


class RecomputeFeature(Feature):
    """Recompute and the per-layer wrapper (which also carries the offload packing: it is put on whenever any
    memory feature is, so every layer opens its layer scope)."""

    name = "recompute"

    def enabled(self, cfg: LongContextConfig) -> bool:
        return cfg.memory.any_enabled

    def check(self, cfg: LongContextConfig, config: Any) -> None:
        mem = cfg.memory
        if mem.recompute_enabled and getattr(config, "recompute_granularity", None):
            raise ValueError(
                "--recompute-granularity: the plugin runs the recompute (MemoryConfig.recompute_granularity="
                f"{mem.recompute_granularity!r}) but the model also has Megatron's own "
                f"(TransformerConfig.recompute_granularity={config.recompute_granularity!r}); set it on one of "
                "them only (the launcher clears Megatron's when the plugin runs it)")
        if mem.recompute_tiles > 1:
            check_tiled_replay(config)

    def model_config(self, config: Any, cfg: LongContextConfig) -> Any:
        """Where the plugin runs the recompute, a copy of ``config`` with Megatron's own off."""
        if not cfg.memory.recompute_enabled or not getattr(config, "recompute_granularity", None):
            return config
        config = copy.copy(config)
        for name in _MEGATRON_RECOMPUTE:
            setattr(config, name, None)
        config.recompute_modules = []
        return config

    def install(self, built: Built, cfg: LongContextConfig) -> Installed:
        mem, layers = cfg.memory, built.layers
        patches: list = []
        if mem.tiled_output_over_input:
            patches += [_refuse_intermediate_outputs(chunk.decoder) for chunk in built.chunks
                        if getattr(chunk, "decoder", None) is not None]
        discard = None
        if mem.recompute_granularity == "selective":
            if "layernorm" in mem.recompute_modules:
                discard = DiscardOutputPacker()
            for layer in layers:
                patches.extend(apply_selective_recompute(layer, mem.recompute_modules, discard))
        recomputed = set()
        if mem.recompute_granularity == "full":
            recomputed = set(full_recompute_layers(len(layers), mem.recompute_method, mem.recompute_num_layers))
        offloader, grad_target = offloader_of(built, cfg), residual_grad_target(built, cfg)
        for index, layer in enumerate(layers):
            recompute = index in recomputed
            plan = LayerPlan(index=index, first=index in built.chunk_starts, recompute=recompute,
                             tiles=mem.recompute_tiles, output_over_input=mem.tiled_output_over_input,
                             offload_here=offloader is not None and (mem.offload_policy != "checkpoint" or recompute),
                             offloader=offloader, discard=discard, grad_target=grad_target)
            patches.append(wrap_layer(layer, plan))
        if mem.recompute_granularity == "full":
            tiles = f", replayed in {mem.recompute_tiles} sequence tiles" if mem.recompute_tiles > 1 else ""
            over = ", output written over input" if mem.tiled_output_over_input else ""
            return Installed(patches=patches, name="full recompute",
                             description=f"{len(recomputed)} of {len(layers)} layers ({mem.recompute_method}){tiles}{over}")
        if mem.recompute_granularity == "selective":
            return Installed(patches=patches, name="selective recompute",
                             description=f"{' '.join(mem.recompute_modules)} in {len(layers)} layers")
        return Installed(patches=patches)
