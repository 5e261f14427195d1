"""Tiled MLP: the MLP runs over sequence tiles; backward recomputes one tile at a time.

Only one tile's ffn-sized intermediate (``[s/n, b, ffn/tp]``) is alive at any moment, in forward and
in backward; the layer keeps just its input.  ALST's TiledMLP (arXiv:2506.13996) and the Mini-Sequence
Transformer (arXiv:2407.15892).  The MLP is token-wise, so tiling the (sequence-parallel) local
sequence is exact under TP: each tile's all-gather/reduce-scatter pairs up on every rank.

Megatron's MLP runs it through :mod:`megatron_longctx.megatron.tiled_mlp` (same parameters and
``state_dict`` keys).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

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
