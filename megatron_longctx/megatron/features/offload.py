"""Activation offload: one offloader per model, scopes around named modules (policy ``modules``), and under
checkpoint offload the embedding output handed to the decoder without a reference of the GPTModel's own.

The offloader is made once per install (:func:`offloader_of`) and shared through ``Built.shared``: the
layer wrapper (:mod:`.recompute`) packs into it and the tiled loss hands it residual gradients.  It reads
the model's parameters afresh at every micro-batch (Megatron moves them after the model is built:
``.cuda()`` after ``--use-cpu-initialization``, the DDP parameter buffer of ``--use-distributed-optimizer``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import torch

from megatron_longctx.config import LongContextConfig
from megatron_longctx.megatron.features.base import Built, Feature, Installed, unwrap
from megatron_longctx.memory import hooks, residual_offload
from megatron_longctx.memory.offload import ActivationOffloader
from megatron_longctx.memory.recompute import SELECTIVE_TARGETS, find_submodule
from megatron_longctx.patching import patch

# Offload policy ``modules``: the submodule each name scopes (norm outputs are saved by their consumer,
# so ``layernorm`` scopes the norms themselves: what the norm's backward keeps).
OFFLOAD_TARGETS: dict[str, tuple[str, ...]] = {
    **SELECTIVE_TARGETS,
    "layernorm": ("input_layernorm", "pre_mlp_layernorm"),
}


def offloader_of(built: Built, cfg: LongContextConfig) -> Optional[ActivationOffloader]:
    """The model's one offloader (``None`` without offload), made on first use."""
    if not cfg.memory.offload_enabled:
        return None
    if "offloader" not in built.shared:
        model = built.model
        # A function, not a tuple: parameters are re-read after Megatron moves or remaps them.
        built.shared["offloader"] = ActivationOffloader(
            cfg.memory, lambda: (p for chunk in unwrap(model) for p in chunk.parameters()), len(built.layers),
            chunk_starts=built.chunk_starts)
    return built.shared["offloader"]


def residual_grad_target(built: Built, cfg: LongContextConfig) -> Optional[residual_offload.Target]:
    """Where residual gradients between tiled layers go (``--longctx-offload-residual-grad``), else ``None``."""
    if not cfg.memory.offload_residual_grad:
        return None
    if "grad_target" not in built.shared:
        offloader = offloader_of(built, cfg)
        built.shared["grad_target"] = residual_offload.Target(
            offloader.disk_dir if cfg.memory.offload_target == "disk" else None, offloader)
    return built.shared["grad_target"]


def _scope_module(module: torch.nn.Module, name: str) -> Callable[[], None]:
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with hooks.module_scope(name):
            return original(*args, **kwargs)

    return patch(module, "forward", forward, f"offload policy modules: saved tensors of {name} are scoped").undo


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


class OffloadFeature(Feature):
    name = "offload"

    def enabled(self, cfg: LongContextConfig) -> bool:
        return cfg.memory.offload_enabled

    def check(self, cfg: LongContextConfig, config: Any) -> None:
        if getattr(config, "cpu_offloading", False) or getattr(config, "fine_grained_activation_offloading", False):
            raise ValueError("--longctx-offload-policy: the model also has Megatron's activation offloading; "
                             "disable --cpu-offloading / --fine-grained-activation-offloading")

    def install(self, built: Built, cfg: LongContextConfig) -> Installed:
        mem = cfg.memory
        offloader = offloader_of(built, cfg)
        patches = []
        if mem.offload_policy == "checkpoint":
            patches += [release_embedding_output(chunk) for chunk in built.chunks
                        if getattr(chunk, "pre_process", False)]
        if mem.offload_policy == "modules":
            for layer in built.layers:
                for name in mem.offload_modules:
                    for path in OFFLOAD_TARGETS[name]:
                        module = find_submodule(layer, path)
                        if module is not None:
                            patches.append(_scope_module(module, name))
        where = f"disk ({offloader.disk_dir})" if mem.offload_target == "disk" else "host"
        what = {"modules": f"modules {' '.join(mem.offload_modules)}",
                "layers": f"layers (first {mem.offload_num_layers or len(built.layers)})"}.get(mem.offload_policy,
                                                                                                "checkpoint")
        description = f"{what} to {where}"
        if residual_grad_target(built, cfg) is not None:
            description += "; residual gradient offload: between tiled layers"
        return Installed(patches=patches, description=description,
                         stats=lambda: dataclasses.asdict(offloader.stats), close=offloader.close)
