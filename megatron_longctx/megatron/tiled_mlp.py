"""The tiled MLP (:mod:`megatron_longctx.memory.tiled_mlp`) in Megatron's models.

One forward, :func:`tiled_forward`, reached two ways with Megatron's parameters and ``state_dict`` keys:
:class:`TiledMLP`, a subclass of ``megatron.core.transformer.mlp.MLP`` a layer spec builds
(:func:`tiled_mlp_spec`), and :func:`tile_mlp_forward` for an MLP already built (Megatron's or TE's
fused one).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from megatron_longctx.memory.tiled_mlp import tiled_mlp
from megatron_longctx.patching import patch


def tiled_forward(base: Callable, num_tiles: int, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``base(hidden_states, **kwargs)`` over ``num_tiles`` sequence tiles; positional extras (another
    caller's protocol) run it whole."""
    if args:
        return base(hidden_states, *args, **kwargs)
    return tiled_mlp(base, hidden_states, num_tiles, **kwargs)


def tile_mlp_forward(mlp: torch.nn.Module, num_tiles: int) -> Callable[[], None]:
    """Make a built MLP module run tiled; returns the function that restores its own forward."""
    forward = functools.wraps(mlp.forward)(functools.partial(tiled_forward, mlp.forward, num_tiles))
    return patch(mlp, "forward", forward, f"tiled MLP: {num_tiles} sequence tiles").undo


def _tiled_mlp_class() -> type:
    from megatron.core.transformer.mlp import MLP

    class TiledMLP(MLP):
        """Megatron's MLP, run over ``num_tiles`` sequence tiles (same parameters and state_dict keys)."""

        def __init__(self, config: Any, submodules: Any, num_tiles: int = 1, pg_collection: Any = None,
                     is_mtp_layer: Optional[bool] = None, name: Optional[str] = None, tp_group: Any = None,
                     **kwargs: Any) -> None:
            del is_mtp_layer, name  # TransformerLayer of newer Megatron passes these to every mlp
            if tp_group is None and pg_collection is not None:
                tp_group = getattr(pg_collection, "tp", None)
            super().__init__(config=config, submodules=submodules, tp_group=tp_group, **kwargs)
            self.num_tiles = num_tiles

        @classmethod
        def as_mlp_submodule(cls, *args: Any, num_tiles: int = 1, **kwargs: Any) -> Any:
            """Newer Megatron's builder entry point (``functools.partial(MLP.as_mlp_submodule, ...)``)."""
            module = super().as_mlp_submodule(*args, **kwargs)
            module.num_tiles = num_tiles
            return module

        def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return tiled_forward(super().forward, self.num_tiles, hidden_states, *args, **kwargs)

    return TiledMLP


@functools.lru_cache(maxsize=None)
def tiled_mlp_type() -> type:
    """The :class:`TiledMLP` class (built on first use so that importing this file needs no Megatron)."""
    return _tiled_mlp_class()


def __getattr__(name: str) -> Any:
    if name == "TiledMLP":
        return tiled_mlp_type()
    raise AttributeError(name)


def tiled_mlp_spec(mlp_spec: Any, num_tiles: int) -> Any:
    """A layer spec's ``mlp`` entry that builds :class:`TiledMLP` instead of ``MLP``.

    Accepts both forms Megatron uses: ``ModuleSpec(module=MLP, submodules=...)`` and (0.19)
    ``functools.partial(MLP.as_mlp_submodule, submodules=...)``.
    """
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    tiled = tiled_mlp_type()
    if isinstance(mlp_spec, ModuleSpec) and mlp_spec.module in (MLP, tiled):
        return ModuleSpec(module=tiled, params={**(mlp_spec.params or {}), "num_tiles": num_tiles},
                          submodules=mlp_spec.submodules)
    func = getattr(mlp_spec, "func", None)
    if isinstance(mlp_spec, functools.partial) and getattr(func, "__self__", None) in (MLP, tiled) \
            and getattr(func, "__name__", "") == "as_mlp_submodule":
        return functools.partial(tiled.as_mlp_submodule, *mlp_spec.args,
                                 **{**mlp_spec.keywords, "num_tiles": num_tiles})
    name = getattr(getattr(mlp_spec, "module", func), "__qualname__", repr(mlp_spec))
    raise ValueError(f"--longctx-tiled-mlp-tiles: tiling supports the dense megatron.core MLP; this spec's mlp is "
                     f"{name!r} (set --longctx-tiled-mlp-tiles 0 for it)")
