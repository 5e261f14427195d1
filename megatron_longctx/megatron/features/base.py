"""The contract between the plugin object and its feature installers.

An installer is one memory feature as Megatron meets it: its checks against the model's config, its edit
of a layer spec (where it has one), its adjustment of the model's config, and its install on a built model,
which returns what it put there (:class:`Installed`) so that the plugin can describe it and take it off
again.  :class:`Built` is the built model as every installer sees it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Optional

import torch

from megatron_longctx.config import LongContextConfig


@dataclasses.dataclass
class Built:
    """The built model as installers see it."""

    model: Any  # as given to install(): a module or a list of chunks (virtual pipeline stages)
    chunks: list[torch.nn.Module]  # unwrapped (DDP / Float16Module removed)
    layers: list[torch.nn.Module]  # every TransformerLayer, in model order
    chunk_starts: list[int]  # index in `layers` of the first layer of each chunk that has layers
    config: Any  # the chunks' TransformerConfig (None if absent)
    shared: dict[str, Any] = dataclasses.field(default_factory=dict)  # what an earlier installer hands a later one

    @classmethod
    def of(cls, model: Any) -> "Built":
        chunks = unwrap(model)
        layers, starts = [], []
        for chunk in chunks:
            in_chunk = transformer_layers([chunk])
            if in_chunk:
                starts.append(len(layers))
            layers.extend(in_chunk)
        return cls(model=model, chunks=chunks, layers=layers, chunk_starts=starts,
                   config=getattr(chunks[0], "config", None) if chunks else None)


@dataclasses.dataclass
class Installed:
    """What one installer put on the model."""

    patches: list[Callable[[], None]] = dataclasses.field(default_factory=list)  # undo callables, undone in reverse
    description: Optional[str] = None  # its part of rank 0's "memory features:" line; None: nothing to report
    stats: Optional[Callable[[], dict[str, int]]] = None
    close: Optional[Callable[[], None]] = None  # called after the patches are undone
    name: Optional[str] = None  # the name in the "memory features:" line, where it is not the feature's own


class Feature:
    """One memory feature's installer; subclasses override what their feature needs."""

    name: str = ""  # as it appears in the "memory features:" line
    # Installed when Megatron's training loop builds the optimizer over the DDP-wrapped model
    # (:meth:`defer`), not on the bare model the provider returns.
    waits_for_optimizer: bool = False

    def enabled(self, cfg: LongContextConfig) -> bool:
        raise NotImplementedError

    def check(self, cfg: LongContextConfig, config: Any) -> None:
        """Raise ``ValueError`` naming the flag and the fix when ``config`` (a TransformerConfig) cannot serve it."""

    def spec(self, spec: Any, cfg: LongContextConfig) -> Any:
        return spec

    def model_config(self, config: Any, cfg: LongContextConfig) -> Any:
        return config

    def install(self, built: Built, cfg: LongContextConfig) -> Installed:
        raise NotImplementedError

    def wrapping_ddp(self, model: Any, cfg: LongContextConfig) -> contextlib.AbstractContextManager:
        """For ``waits_for_optimizer`` features: a context Megatron's DDP wraps ``model`` in, for a caller that
        wraps it itself and then calls :meth:`install` (the deferred install enters its own)."""
        return contextlib.nullcontext()

    def building_optimizer(self, installed: Installed) -> contextlib.AbstractContextManager:
        """For ``waits_for_optimizer`` features: a context Megatron's optimizer is built in over the model they
        went on (``get_megatron_optimizer``)."""
        return contextlib.nullcontext()

    def wire_optimizer(self, installed: Installed, optimizer: Any, cfg: LongContextConfig) -> Any:
        """For ``waits_for_optimizer`` features: the optimizer built over the model they went on, with their hooks
        (returned; the default leaves it as it is)."""
        return optimizer

    def defer(self, model: Any, cfg: LongContextConfig, who: str, line: Optional[str]) -> None:
        """For ``waits_for_optimizer`` features: install on ``model`` once the optimizer is built over it;
        rank 0 then prints the "memory features:" line (``line``: what the other features installed)."""
        raise NotImplementedError


def unwrap(model: Any) -> list[torch.nn.Module]:
    """The model chunks without their DDP / Float16Module wrappers."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    out = []
    for chunk in chunks:
        while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
            chunk = chunk.module
        out.append(chunk)
    return out


def transformer_layers(chunks: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]
