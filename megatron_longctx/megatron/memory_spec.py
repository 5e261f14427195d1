"""Wire the memory features (:mod:`megatron_longctx.memory`) into Megatron: a layer-spec edit and hooks
on a built model.

:func:`apply_memory_to_layer_spec` makes the spec build a :class:`TiledMLP` (same parameters and keys).
:func:`install` puts the rest on a built model and returns a handle whose ``remove()`` undoes it:

1. tiled MLP on MLPs the spec did not already tile, the tiled loss on the post-process stage, and the
   lean RMSNorm (``--longctx-lean-norm``); under checkpoint offload, the embedding output handed to the
   decoder without a reference of the GPTModel's own (:func:`release_embedding_output`);
2. selective recompute wrappers (innermost: they change what a module saves);
3. offload scopes around named modules (policy ``modules``);
4. one wrapper per transformer layer, outermost, in this order from the outside in: layer scope,
   offload packer, discard-output packer, full-recompute checkpoint.  The offload packer sits outside
   the checkpoint so it sees exactly what a recomputed layer keeps, its inputs (ALST checkpoint
   offload); the discard packer sits inside the offload packer so a norm output is recomputed rather
   than offloaded.

The offloader reads the model's parameters afresh at every micro-batch (Megatron moves them after the
model is built: ``.cuda()`` after ``--use-cpu-initialization``, the DDP parameter buffer of
``--use-distributed-optimizer``), and learns which layers begin a model chunk (virtual pipeline).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
from typing import Any, Callable, Iterable, Optional

import torch

from megatron_longctx.config import LongContextConfig, MemoryConfig
from megatron_longctx.megatron.core_attention import NvtxRanges
from megatron_longctx.megatron.spec_walk import KEEP, built_class, walk_spec
from megatron_longctx.megatron.tiled_loss import install_tiled_loss
from megatron_longctx.megatron.tiled_mlp import tile_mlp_forward, tiled_mlp_spec, tiled_mlp_type
from megatron_longctx.memory import hooks, residual_offload
from megatron_longctx.memory.offload import ActivationOffloader
from megatron_longctx.memory.recompute import (
    SELECTIVE_TARGETS,
    DiscardOutputPacker,
    apply_selective_recompute,
    checkpoint,
    find_submodule,
    full_recompute_layers,
)
from megatron_longctx.memory.rmsnorm import install_lean_norms
from megatron_longctx.memory.tiled_recompute import tile_attention_of, tiled_checkpoint
from megatron_longctx.patching import patch

# Offload policy ``modules``: the submodule each name scopes (norm outputs are saved by their consumer,
# so ``layernorm`` scopes the norms themselves: what the norm's backward keeps).
OFFLOAD_TARGETS: dict[str, tuple[str, ...]] = {
    **SELECTIVE_TARGETS,
    "layernorm": ("input_layernorm", "pre_mlp_layernorm"),
}


def apply_memory_to_layer_spec(layer_spec: Any, cfg: MemoryConfig) -> Any:
    """A copy of a TransformerLayer ``ModuleSpec`` with the spec-level memory features applied.

    Today that is the tiled MLP (``--longctx-tiled-mlp-tiles`` > 1): the dense MLP becomes
    :class:`TiledMLP` (same parameters and ``state_dict`` keys).  Also accepts any spec tree that holds
    layer specs (a list, a block or stack spec: :func:`.spec_walk.walk_spec`).  Everything else needs a
    built model: see :func:`install`.
    """
    if not isinstance(cfg, MemoryConfig):
        raise ValueError(f"apply_memory_to_layer_spec: cfg must be a MemoryConfig, got {type(cfg).__name__}")
    if cfg.tiled_mlp_tiles <= 1:
        return layer_spec
    return _tile_spec(layer_spec, cfg.tiled_mlp_tiles)


_UNTILED_MLPS = ("IdentityOp", "MoELayer")


def _tile_spec(spec: Any, num_tiles: int) -> Any:
    def rule(submodules: Any, name: str, entry: Any) -> Any:
        # a layer's mlp; an attention-only layer has none (IdentityOp), MoE layers route over the whole sequence
        if name != "mlp" or getattr(built_class(entry), "__name__", "") in _UNTILED_MLPS:
            return KEEP
        return tiled_mlp_spec(entry, num_tiles)

    out, tiled = walk_spec(spec, rule)
    if tiled == 0:
        raise ValueError(f"--longctx-tiled-mlp-tiles: no TransformerLayer spec with a dense mlp in "
                         f"{type(spec).__name__}; pass a layer spec (e.g. get_gpt_layer_local_spec()) or set the "
                         "option to 0")
    return out


@dataclasses.dataclass
class MemoryHandle:
    """What :func:`install` put on a model; ``remove()`` takes it all off again."""

    cfg: MemoryConfig
    layers: list
    offloader: Optional[ActivationOffloader]
    removers: list = dataclasses.field(default_factory=list)
    active: dict = dataclasses.field(default_factory=dict)  # feature -> what it was put on (describe())

    def describe(self) -> str:
        """One line: each feature put on the model and where (e.g. ``tiled MLP: 4 tiles on 2 MLPs``)."""
        return "; ".join(f"{name}: {what}" for name, what in self.active.items()) or "none"

    def stats(self) -> dict[str, int]:
        """The offloader's byte counters so far (``{}`` without offload)."""
        return dataclasses.asdict(self.offloader.stats) if self.offloader is not None else {}

    def remove(self) -> None:
        while self.removers:
            self.removers.pop()()
        if self.offloader is not None:
            self.offloader.close()


def _unwrap(model: Any) -> list[torch.nn.Module]:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    out = []
    for chunk in chunks:
        while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
            chunk = chunk.module  # DDP / Float16Module wrappers
        out.append(chunk)
    return out


def _transformer_layers(chunks: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]


def _validate_against_model(cfg: MemoryConfig, chunks: list[torch.nn.Module]) -> None:
    config = getattr(chunks[0], "config", None)
    if config is None:
        return
    if cfg.recompute_enabled and getattr(config, "recompute_granularity", None):
        raise ValueError(
            "--recompute-granularity: the plugin runs the recompute (MemoryConfig.recompute_granularity="
            f"{cfg.recompute_granularity!r}) but the model also has Megatron's own "
            f"(TransformerConfig.recompute_granularity={config.recompute_granularity!r}); set it on one of them "
            "only (the launcher clears Megatron's when the plugin runs it)")
    if cfg.recompute_tiles > 1:
        _check_tiled_replay(config)
    if cfg.offload_enabled and (getattr(config, "cpu_offloading", False)
                                or getattr(config, "fine_grained_activation_offloading", False)):
        raise ValueError("--longctx-offload-policy: the model also has Megatron's activation offloading; "
                         "disable --cpu-offloading / --fine-grained-activation-offloading")


def _check_tiled_replay(config: Any) -> None:
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


def _scope_module(module: torch.nn.Module, name: str) -> Callable[[], None]:
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with hooks.module_scope(name):
            return original(*args, **kwargs)

    return patch(module, "forward", forward, f"offload policy modules: saved tensors of {name} are scoped").undo


def _wrap_layer(layer: torch.nn.Module, index: int, first: bool, cfg: MemoryConfig, recompute: bool,
                offloader: Optional[ActivationOffloader], discard: Optional[DiscardOutputPacker],
                grad_target: Optional[residual_offload.Target] = None) -> Callable[[], None]:
    original = layer.forward
    offload_here = offloader is not None and (cfg.offload_policy != "checkpoint" or recompute)
    attention = tile_attention_of(layer) if recompute and cfg.recompute_tiles > 1 else None

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if first and offloader is not None and torch.is_grad_enabled():
            offloader.next_microbatch()
        with contextlib.ExitStack() as stack:
            stack.enter_context(hooks.layer_scope(index))
            if offload_here:
                stack.enter_context(hooks.packing(offloader))
            if discard is not None:
                stack.enter_context(hooks.packing(discard))
            try:
                if recompute and cfg.recompute_tiles > 1:
                    return tiled_checkpoint(original, cfg.recompute_tiles, layer.parameters, *args, attention=attention,
                                            grad_target=grad_target, output_over_input=cfg.tiled_output_over_input,
                                            ranges=NvtxRanges(), **kwargs)
                return checkpoint(original, *args, **kwargs) if recompute else original(*args, **kwargs)
            finally:
                if discard is not None:
                    discard.clear()

    what = "recompute" if recompute else "offload"
    return patch(layer, "forward", forward, f"layer {index}: {what} of its saved tensors").undo


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


def release_embedding_output(gpt_model: Any) -> Callable[[], None]:
    """Hand ``gpt_model``'s embedding output to its decoder without keeping a reference of its own.

    ``GPTModel.forward`` holds the embedding output (the first layer's input) in a local until it
    returns, so it stays on the device through the whole forward even when the first layer's
    checkpoint offload has moved it off.  At inference Megatron passes it as a ``WrappedTensor``, which
    the decoder unwraps, leaving no reference behind; this does the same in every forward whose
    embedding output nothing else reads (no multi-token prediction, config logger or
    ``output_processor``, which receive it).  Returns the function that undoes it.
    """
    try:
        from megatron.core.config_logger import has_config_logger_enabled
        from megatron.core.utils import WrappedTensor
    except ImportError:  # a Megatron without WrappedTensor: the reference stays, nothing else changes
        return lambda: None
    if not hasattr(gpt_model, "_preprocess") or getattr(gpt_model, "mtp_process", False):
        return lambda: None
    original_preprocess, original_forward = gpt_model._preprocess, gpt_model.forward
    active: list = []

    @functools.wraps(original_preprocess)
    def preprocess(*args: Any, **kwargs: Any) -> Any:
        out = original_preprocess(*args, **kwargs)
        if (active and isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor)
                and not has_config_logger_enabled(gpt_model.config)):
            out = (WrappedTensor(out[0]),) + out[1:]
        return out

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("output_processor") is not None:
            return original_forward(*args, **kwargs)
        active.append(True)
        try:
            return original_forward(*args, **kwargs)
        finally:
            active.pop()

    reason = "the embedding output is handed to the decoder without a reference kept"
    patches = [patch(gpt_model, "_preprocess", preprocess, reason), patch(gpt_model, "forward", forward, reason)]

    def remove() -> None:
        for done in reversed(patches):
            done.undo()

    return remove


def install(model: Any, cfg: MemoryConfig) -> MemoryHandle:
    """Put offload, recompute, tiled MLP and tiled loss (per ``cfg``) on a built Megatron model.

    ``model``: a GPTModel (or any module holding TransformerLayers), possibly wrapped (DDP,
    Float16Module), or a list of such chunks (virtual pipeline stages).  Megatron's own recompute and
    offloading must be off for the features enabled here.  Returns a :class:`MemoryHandle`.
    """
    if not isinstance(cfg, MemoryConfig):
        raise ValueError(f"install: cfg must be a MemoryConfig, got {type(cfg).__name__}")
    chunks = _unwrap(model)
    _validate_against_model(cfg, chunks)
    layers = _transformer_layers(chunks)
    starts, seen = [], 0
    for chunk in chunks:
        in_chunk = len(_transformer_layers([chunk]))
        if in_chunk:
            starts.append(seen)
        seen += in_chunk
    offloader = None
    if cfg.offload_enabled:
        # A function, not a tuple: parameters are re-read after Megatron moves or remaps them.
        offloader = ActivationOffloader(cfg, lambda: (p for chunk in _unwrap(model) for p in chunk.parameters()),
                                        len(layers), chunk_starts=starts)
    handle = MemoryHandle(cfg=cfg, layers=layers, offloader=offloader)
    grad_target = None
    if cfg.offload_residual_grad:
        grad_target = residual_offload.Target(offloader.disk_dir if cfg.offload_target == "disk" else None, offloader)
    if cfg.tiled_mlp_tiles > 1:
        tiled = tiled_mlp_type()
        mlps = [getattr(layer, "mlp", None) for layer in layers]
        dense = [m for m in mlps if type(m).__name__ in ("MLP", "TEFusedMLP") and not isinstance(m, tiled)]
        if layers and not dense and not any(isinstance(m, tiled) for m in mlps):
            raise ValueError("--longctx-tiled-mlp-tiles: the model has no dense MLP to tile (MoE layers are not "
                             "tiled); set it to 0")
        for mlp in dense:
            handle.removers.append(tile_mlp_forward(mlp, cfg.tiled_mlp_tiles))
        handle.active["tiled MLP"] = f"{cfg.tiled_mlp_tiles} tiles on {sum(m is not None for m in mlps)} MLPs"
    if cfg.tiled_loss_tiles > 1:
        losses = 0
        for chunk in chunks:
            if getattr(chunk, "post_process", False) and hasattr(chunk, "compute_language_model_loss"):
                handle.removers.append(install_tiled_loss(chunk, cfg.tiled_loss_tiles, cfg.tiled_loss_recompute,
                                                          grad_target))
                losses += 1
        if losses:
            handle.active["tiled loss"] = (f"{cfg.tiled_loss_tiles} tiles"
                                           f"{', logits recomputed in backward' if cfg.tiled_loss_recompute else ''}")
    if cfg.lean_norm:
        norms = install_lean_norms(chunks)
        handle.removers.extend(norms)
        handle.active["lean RMSNorm"] = f"{len(norms)} norms" if norms else "none (the model has no torch RMSNorm)"
    if cfg.tiled_output_over_input:
        for chunk in chunks:
            decoder = getattr(chunk, "decoder", None)
            if decoder is not None:
                handle.removers.append(_refuse_intermediate_outputs(decoder))
    if cfg.offload_policy == "checkpoint":
        for chunk in chunks:
            if getattr(chunk, "pre_process", False):
                handle.removers.append(release_embedding_output(chunk))
    discard = None
    if cfg.recompute_granularity == "selective":
        if "layernorm" in cfg.recompute_modules:
            discard = DiscardOutputPacker()
        for layer in layers:
            handle.removers.extend(apply_selective_recompute(layer, cfg.recompute_modules, discard))
    if cfg.offload_policy == "modules":
        for layer in layers:
            for name in cfg.offload_modules:
                for path in OFFLOAD_TARGETS[name]:
                    module = find_submodule(layer, path)
                    if module is not None:
                        handle.removers.append(_scope_module(module, name))
    recomputed = set()
    if cfg.recompute_granularity == "full":
        recomputed = set(full_recompute_layers(len(layers), cfg.recompute_method, cfg.recompute_num_layers))
    for index, layer in enumerate(layers):
        handle.removers.append(_wrap_layer(layer, index, index in starts, cfg, index in recomputed,
                                           offloader, discard, grad_target))
    _describe_layers(handle, cfg, len(recomputed), grad_target)
    return handle


def _describe_layers(handle: MemoryHandle, cfg: MemoryConfig, recomputed: int,
                     grad_target: Optional[residual_offload.Target]) -> None:
    layers = len(handle.layers)
    if cfg.recompute_granularity == "full":
        tiles = f", replayed in {cfg.recompute_tiles} sequence tiles" if cfg.recompute_tiles > 1 else ""
        over = ", output written over input" if cfg.tiled_output_over_input else ""
        handle.active["full recompute"] = f"{recomputed} of {layers} layers ({cfg.recompute_method}){tiles}{over}"
    elif cfg.recompute_granularity == "selective":
        handle.active["selective recompute"] = f"{' '.join(cfg.recompute_modules)} in {layers} layers"
    if handle.offloader is not None:
        where = f"disk ({handle.offloader.disk_dir})" if cfg.offload_target == "disk" else "host"
        what = {"modules": f"modules {' '.join(cfg.offload_modules)}",
                "layers": f"layers (first {cfg.offload_num_layers or layers})"}.get(cfg.offload_policy, "checkpoint")
        handle.active["offload"] = f"{what} to {where}"
    if grad_target is not None:
        handle.active["residual gradient offload"] = "between tiled layers"


def megatron_config_without_plugin_recompute(config: Any, cfg: MemoryConfig) -> Any:
    """``config`` (a TransformerConfig) as the model is built with it: where the plugin runs the recompute
    (:func:`megatron_longctx.megatron.arguments.plugin_recompute` says when), a copy with Megatron's off."""
    if not cfg.recompute_enabled or not getattr(config, "recompute_granularity", None):
        return config
    config = copy.copy(config)
    for name in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        setattr(config, name, None)
    config.recompute_modules = []
    return config


def install_and_report(model: Any, cfg: LongContextConfig, who: str = "megatron-longctx") -> Optional[MemoryHandle]:
    """:func:`install` the memory features of ``cfg`` (if any) on a built ``model`` (a module or a list of
    chunks, each of which then holds the handle as ``_longctx_memory_handle``); rank 0 prints one line."""
    handle = install(model, cfg.memory) if cfg.memory.any_enabled else None
    if cfg.model_states.enabled:  # installed once DDP wraps the model; it prints the features line then
        from megatron_longctx.megatron.features.model_states import FEATURE

        FEATURE.defer(model, cfg, who, handle.describe() if handle is not None else None)
    if handle is None:
        return None
    for chunk in model if isinstance(model, list) else [model]:
        chunk._longctx_memory_handle = handle
    if os.environ.get("RANK", "0") == "0":
        mem = cfg.memory
        if mem.recompute_enabled:
            what = (f"selective: {' '.join(mem.recompute_modules)}" if mem.recompute_granularity == "selective"
                    else f"full: {mem.recompute_method}")
            print(f"{who}: Megatron's --recompute-granularity ({what}) runs in the plugin's recompute on "
                  f"{len(handle.layers)} layers (see plugin_recompute)", flush=True)
        if not cfg.model_states.enabled:
            print(f"{who}: memory features: {handle.describe()}", flush=True)
    return handle

