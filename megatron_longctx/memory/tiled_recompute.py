"""Full recompute in sequence tiles: a checkpointed layer replayed one tile of tokens at a time.

Full recompute keeps a layer's input and reruns the whole layer in backward, so backward still holds
every activation of one layer for the whole sequence.  Everything in a transformer layer but the
attention is token-wise, so the replay can run one tile of tokens at a time if the attention of a
query tile can see all keys.  :func:`tiled_checkpoint` replays in three passes, each over the tiles:

1. *collect*: each tile runs up to its core attention, which stores the tile's K/V and stops the
   layer there (:class:`ReplayStop`); the K/V are then gathered once (:class:`~megatron_longctx.
   attention.tiled.TiledKV`);
2. *attend*: each tile runs the whole layer, its queries attending over the gathered K/V, and
   backpropagates its share of the output gradient (into the tile's input, the parameters, and the
   gathered dK/dV);
3. *K/V gradients*: dK/dV are reduce-scattered to their owners, and each tile runs up to its core
   attention again to backpropagate its dK/dV into the tile's input and the parameters.

Forward is passes 1 and 2 without gradients.  Peak memory per token is then the layer's input and
output gradients, the gathered K/V and dK/dV, and one tile's activations (FPDT, Yao et al. 2024,
arXiv:2408.16978, runs a layer in sequence chunks the same way); the layer input too, unless the
checkpoint offload holds it (:func:`hooks.pack_rows`: each pass reads it back one tile at a time).  Parameter gradients are summed
over the tiles (straight into Megatron's ``main_grad`` where its DDP allows, :mod:`grad_buffers`) and
returned by one autograd node, so gradient hooks (Megatron's DDP) fire once per parameter, as without
tiling.

The core attention takes part through :func:`current`: while a replay is active it reads the
replay's ``mode`` and tile (``lo``, ``hi``) and keeps its per-layer state in :meth:`_Replay.state_for`.
The attention implementation lives with it (:mod:`megatron_longctx.megatron.core_attention`).
Dropout is not replayed per tile (a tile would draw other masks than the whole layer): callers
refuse it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree

from megatron_longctx.memory import grad_buffers, hooks
from megatron_longctx.memory.recompute import RngSnapshot, _SwapRng

COLLECT = "collect"  # store the tile's K/V, stop at the core attention
ATTEND = "attend"  # attend the tile's queries over the gathered K/V, run the layer to its end
KV_GRAD = "kv_grad"  # stop at the core attention with the tile's (k, v) and their gradients

# Keyword arguments of a TransformerLayer that hold one row per token (cut per tile with the input).
PER_TOKEN_KWARGS = ("rotary_pos_emb", "rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin")
# Keyword arguments a tiled replay cannot cut per tile.
REFUSED_KWARGS = ("context", "context_mask", "packed_seq_params", "padding_mask", "inference_context",
                  "inference_params", "attention_bias")


class ReplayStop(Exception):
    """Raised by the core attention to end a tile's replay there (passes 1 and 3).

    In pass 3 it carries the tile's ``outputs`` (k, v) and their ``grads`` (dK, dV).
    """

    def __init__(self, outputs: tuple = (), grads: tuple = ()) -> None:
        super().__init__("tiled replay stopped at the core attention")
        self.outputs, self.grads = outputs, grads


@dataclasses.dataclass
class _Replay:
    """One layer's replay: the pass, the tile being run, and the core attention's state."""

    seq_len: int  # this rank's tokens
    mode: str = COLLECT
    lo: int = 0
    hi: int = 0
    state: Any = None
    owner: Any = None  # the module whose state this is

    def state_for(self, owner: Any, make: Callable[[], Any]) -> Any:
        """The per-layer state of ``owner`` (made on first use); one core attention per replayed layer."""
        if self.state is None:
            self.state, self.owner = make(), owner
        elif self.owner is not owner:
            raise ValueError("--longctx-recompute-tiles: a tiled layer holds more than one core attention; "
                             "tile layers with one self-attention only, or set --longctx-recompute-tiles 0")
        return self.state


_ACTIVE: list[_Replay] = []


def current() -> Optional[_Replay]:
    """The replay in progress in this process, if any (read by the core attention)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def _active(replay: _Replay) -> Iterator[None]:
    _ACTIVE.append(replay)
    try:
        yield
    finally:
        _ACTIVE.pop()


def tile_bounds(seq_len: int, num_tiles: int) -> list[tuple[int, int]]:
    """``num_tiles`` (at most ``seq_len``) contiguous ``[lo, hi)`` covering ``[0, seq_len)``, sizes within one."""
    n = max(1, min(num_tiles, seq_len))
    cuts = [seq_len * i // n for i in range(n + 1)]
    return [(lo, hi) for lo, hi in zip(cuts, cuts[1:])]


@dataclasses.dataclass
class _TiledCall:
    """One replayed layer call: the function, its arguments, and what each tile gets."""

    # The hidden states themselves are never held here: the layer input must die with the forward
    # unless save_for_backward's packer (checkpoint offload) keeps it.
    fn: Callable
    positional: bool  # the hidden states came as the first positional argument (else as a keyword)
    rest: tuple  # the positional arguments after the hidden states
    kwargs: dict
    num_tiles: int
    rng: RngSnapshot
    out_spec: Any = None
    token_slots: Optional[list] = None  # output leaves with one row per token (concatenated over tiles)
    other_leaves: Optional[list] = None  # the remaining output leaves, as the first tile returned them

    def run_tile(self, x_t: torch.Tensor, lo: int, hi: int) -> Any:
        kwargs = {k: (_rows(v, lo, hi) if k in PER_TOKEN_KWARGS else v) for k, v in self.kwargs.items()}
        if self.positional:
            return self.fn(x_t, *self.rest, **kwargs)
        return self.fn(hidden_states=x_t, **kwargs)


def _rows(value: Any, lo: int, hi: int) -> Any:
    """Rows ``[lo, hi)`` (dim 0) of every tensor in ``value`` (a tensor, a tuple of them, or None)."""
    return pytree.tree_map(lambda t: t[lo:hi] if isinstance(t, torch.Tensor) else t, value)


Rows = Callable[[int, int], torch.Tensor]  # rows [lo, hi) of the layer input


def _collect(call: _TiledCall, rows: Rows, seq_len: int, with_grads: bool) -> _Replay:
    """Pass 1: every tile's K/V stored by the core attention, then gathered."""
    replay = _Replay(seq_len=seq_len)
    with torch.no_grad(), _active(replay):
        for lo, hi in tile_bounds(seq_len, call.num_tiles):
            replay.lo, replay.hi = lo, hi
            try:
                call.run_tile(rows(lo, hi), lo, hi)
            except ReplayStop:
                continue
            raise ValueError("--longctx-recompute-tiles: the layer ran to its end without reaching the plugin's "
                             "core attention; build the model with megatron_longctx.apply_to_spec "
                             "(ContextParallelAttention as core_attention) or set --longctx-recompute-tiles 0")
    replay.state.gather(with_grads)
    return replay


def _forward(call: _TiledCall, x: torch.Tensor) -> list[torch.Tensor]:
    """Passes 1 and 2 without gradients: the layer's outputs, one tile at a time."""
    replay = _collect(call, lambda lo, hi: x[lo:hi], x.shape[0], with_grads=False)
    replay.mode = ATTEND
    outs: list[torch.Tensor] = []
    with torch.no_grad(), _active(replay):
        for lo, hi in tile_bounds(x.shape[0], call.num_tiles):
            replay.lo, replay.hi = lo, hi
            leaves, spec = pytree.tree_flatten(call.run_tile(x[lo:hi], lo, hi))
            if call.token_slots is None:
                call.out_spec = spec
                call.token_slots = [i for i, o in enumerate(leaves)
                                    if isinstance(o, torch.Tensor) and o.dim() > 0 and o.shape[0] == hi - lo]
                call.other_leaves = [None if i in call.token_slots else o for i, o in enumerate(leaves)]
                outs = [leaves[i].new_empty((x.shape[0], *leaves[i].shape[1:])) for i in call.token_slots]
            for out, i in zip(outs, call.token_slots):
                out[lo:hi] = leaves[i]
    replay.state.release()
    return outs


def _backward(call: _TiledCall, rows: Rows, dx: torch.Tensor, params: tuple, grads: tuple) -> tuple:
    """Passes 1-3 with gradients into ``dx`` (the layer input's shape): (dx, *parameter gradients).

    ``rows(lo, hi)`` gives the layer input's rows, read again in every pass (an offloaded input comes
    back one tile at a time).  Pass 2 writes every tile's rows of ``dx`` after the tile's rows of the
    output gradient are consumed, so ``dx`` may be that gradient's buffer (:mod:`grad_buffers`)."""
    replay = _collect(call, rows, dx.shape[0], with_grads=True)
    dparams = grad_buffers.ParamGrads(params)
    tiles = tile_bounds(dx.shape[0], call.num_tiles)
    replay.mode = ATTEND
    for lo, hi in tiles:
        replay.lo, replay.hi = lo, hi
        x_t = rows(lo, hi).detach().requires_grad_(True)
        with torch.enable_grad(), _active(replay):
            leaves = pytree.tree_leaves(call.run_tile(x_t, lo, hi))
        outs, out_grads = [], []
        for i, g in zip(call.token_slots, grads):
            if g is not None and leaves[i].requires_grad:
                outs.append(leaves[i])
                out_grads.append(g[lo:hi])
        if outs:
            got = torch.autograd.grad(outs, (x_t, *params), out_grads, allow_unused=True)
            dparams.add(got[1:])
        else:
            got = (None,)
        if got[0] is not None:
            dx[lo:hi] = got[0]
        else:
            dx[lo:hi].zero_()
        del leaves, outs, out_grads, got
    replay.state.reduce_grads()
    replay.mode = KV_GRAD
    for lo, hi in tiles:
        replay.lo, replay.hi = lo, hi
        x_t = rows(lo, hi).detach().requires_grad_(True)
        try:
            with torch.enable_grad(), _active(replay):
                call.run_tile(x_t, lo, hi)
        except ReplayStop as stop:
            got = torch.autograd.grad(stop.outputs, (x_t, *params), stop.grads, allow_unused=True)
        else:
            raise RuntimeError("tiled replay: the layer did not stop at its core attention in the K/V pass")
        if got[0] is not None:
            dx[lo:hi] += got[0]
        dparams.add(got[1:])
        del got
    replay.state.release()
    return (dx, *dparams.result())


class TiledCheckpointFunction(torch.autograd.Function):
    """Keeps the layer input and replays the layer in tiles.

    An offload packer that serves row ranges (:func:`hooks.pack_rows`: the checkpoint offload) takes the
    input, and backward reads it back one tile at a time, never whole; otherwise it is saved with
    ``save_for_backward`` (any outer packer sees it as usual).
    """

    @staticmethod
    def forward(ctx, call: _TiledCall, x: torch.Tensor, *params: torch.Tensor):  # type: ignore[override]
        ctx.call, ctx.params = call, params
        ctx.rows_item = hooks.pack_rows(x)
        ctx.input_like = (x.shape, x.dtype, x.device)
        ctx.watch = grad_buffers.Watch(x)
        if ctx.rows_item is None:
            ctx.save_for_backward(x)
        with hooks.paused():
            return tuple(_forward(call, x.detach()))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        item, ctx.rows_item = ctx.rows_item, None  # the offloaded copy is released with this backward
        if item is None:
            x = ctx.saved_tensors[0].detach()
            rows: Rows = lambda lo, hi: x[lo:hi]  # noqa: E731
        else:
            rows = functools.partial(hooks.unpack_rows, item)
        shape, dtype, device = ctx.input_like
        # the input's gradient in the output gradient's buffer when that is a plugin's own and the only one
        reuse = len(grads) == 1 and grad_buffers.reusable(grads[0], shape, dtype, device)
        dx = grads[0] if reuse else torch.empty(shape, dtype=dtype, device=device)
        with _SwapRng(ctx.call.rng), hooks.paused():
            dx, *dparams = _backward(ctx.call, rows, dx, ctx.params, grads)
        return (None, grad_buffers.own(dx, ctx.watch), *dparams)


def tiled_checkpoint(fn: Callable, num_tiles: int, params: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (a transformer layer) kept as its input and replayed in ``num_tiles`` tiles.

    The first argument (or ``hidden_states``) is ``[s, b, h]``, cut along ``s``; the rotary
    embeddings (:data:`PER_TOKEN_KWARGS`) are cut with it; ``params()`` gives the layer's parameters.
    Every tensor output with one row per token is concatenated over the tiles; other outputs come
    from the first tile.  Without grad mode this is ``fn(*args, **kwargs)``.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    x = args[0] if args else kwargs.pop("hidden_states")
    for name in REFUSED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"--longctx-recompute-tiles: the layer got {name}=..., which a replay cut in "
                             f"sequence tiles cannot serve; set --longctx-recompute-tiles 0")
    others = [t for t in pytree.tree_leaves((args[1:], kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    if others:
        raise ValueError("--longctx-recompute-tiles: only the layer's hidden states may require grad "
                         "(another tensor argument does); set --longctx-recompute-tiles 0")
    call = _TiledCall(fn=fn, positional=bool(args), rest=tuple(args[1:]), kwargs=kwargs, num_tiles=num_tiles,
                      rng=RngSnapshot.capture())
    trainable = tuple(p for p in params() if p.requires_grad)
    outs = TiledCheckpointFunction.apply(call, x, *trainable)
    leaves = list(call.other_leaves)
    for slot, o in zip(call.token_slots, outs):
        leaves[slot] = o
    return pytree.tree_unflatten(leaves, call.out_spec)
