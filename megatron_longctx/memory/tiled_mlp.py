"""Tiled MLP: the MLP runs over sequence tiles; backward recomputes one tile at a time.

Only one tile's ffn-sized intermediate (``[s/n, b, ffn/tp]``) is alive at any moment, in forward and
in backward; the layer keeps just its input.  ALST's TiledMLP (arXiv:2506.13996) and the Mini-Sequence
Transformer (arXiv:2407.15892).  The MLP is token-wise, so tiling the (sequence-parallel) local
sequence is exact under TP: each tile's all-gather/reduce-scatter pairs up on every rank.

Two ways in, same parameters and ``state_dict`` keys as Megatron's MLP:
:class:`TiledMLP` (a subclass of ``megatron.core.transformer.mlp.MLP`` for layer specs, see
:func:`tiled_mlp_spec`) and :func:`tile_mlp_forward` (wraps a built MLP's ``forward``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import torch

from megatron_longctx.memory import hooks


@dataclasses.dataclass
class _Tiles:
    fn: Callable  # mlp forward: hidden [t, b, h] -> (out [t, b, h], bias or None)
    num_tiles: int
    kwargs: dict
    bias: Any = None


def _bounds(s: int, num_tiles: int) -> list[tuple[int, int]]:
    step, extra = divmod(s, num_tiles)
    bounds, start = [], 0
    for i in range(num_tiles):
        end = start + step + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def tiled_mlp_forward(tiles: _Tiles, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[s, b, h]`` -> MLP output ``[s, b, h]``, one sequence tile at a time, no graph kept."""
    outs = []
    with torch.no_grad(), hooks.paused():
        for start, end in _bounds(x.shape[0], tiles.num_tiles):
            out, bias = tiles.fn(x[start:end], **tiles.kwargs)  # [t, b, h]
            outs.append(out)
            tiles.bias = bias
    return torch.cat(outs, dim=0)  # [s, b, h]


def tiled_mlp_backward(tiles: _Tiles, x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """Recompute tile by tile; weight grads accumulate in ``.grad``; returns ``d x`` ``[s, b, h]``."""
    grad_x = torch.empty_like(x) if x.requires_grad else None
    for start, end in _bounds(x.shape[0], tiles.num_tiles):
        tile = x[start:end].detach().requires_grad_(x.requires_grad)  # [t, b, h]
        with torch.enable_grad(), hooks.paused():
            out, _ = tiles.fn(tile, **tiles.kwargs)
        torch.autograd.backward(out, grad_out[start:end])
        if grad_x is not None:
            grad_x[start:end] = tile.grad
    return grad_x


class TiledMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tiles: _Tiles, x: torch.Tensor):  # type: ignore[override]
        ctx.tiles = tiles
        ctx.save_for_backward(x)
        return tiled_mlp_forward(tiles, x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return None, tiled_mlp_backward(ctx.tiles, x, grad_out)


def tiled_mlp(fn: Callable, hidden_states: torch.Tensor, num_tiles: int, **kwargs: Any) -> tuple:
    """Run an MLP forward ``fn`` (``[s, b, h] -> (out, bias)``) over ``num_tiles`` sequence tiles.

    Returns ``(out [s, b, h], bias)`` as Megatron's MLP does; a returned bias parameter is passed
    through untouched (never through the autograd Function).
    """
    if num_tiles < 1:
        raise ValueError(f"--longctx-tiled-mlp-tiles: got {num_tiles}; give an integer >= 1")
    if num_tiles == 1:
        return fn(hidden_states, **kwargs)
    if hidden_states.shape[0] < num_tiles:
        raise ValueError(f"--longctx-tiled-mlp-tiles: {num_tiles} tiles but only {hidden_states.shape[0]} "
                         "tokens in the local sequence; lower the number of tiles")
    tiles = _Tiles(fn=fn, num_tiles=num_tiles, kwargs=kwargs)
    if not torch.is_grad_enabled():  # e.g. full recompute's first forward: tiled too, or [s, b, ffn] peaks there
        return tiled_mlp_forward(tiles, hidden_states), tiles.bias
    out = TiledMLPFunction.apply(tiles, hidden_states)
    return out, tiles.bias


def tile_mlp_forward(mlp: torch.nn.Module, num_tiles: int) -> Callable[[], None]:
    """Make a built MLP module run tiled; returns the function that restores its own forward."""
    original = mlp.forward

    @functools.wraps(original)
    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args:
            return original(hidden_states, *args, **kwargs)
        return tiled_mlp(original, hidden_states, num_tiles, **kwargs)

    mlp.forward = forward

    def restore() -> None:
        if mlp.__dict__.get("forward") is forward:
            del mlp.__dict__["forward"]

    return restore


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
            base = super().forward
            if args:
                return base(hidden_states, *args, **kwargs)
            return tiled_mlp(base, hidden_states, self.num_tiles, **kwargs)

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
