"""Full recompute in sequence tiles: a checkpointed layer replayed one tile of tokens at a time.

:func:`tiled_checkpoint` keeps a layer's input and replays the layer in three passes over the tiles
(:class:`Pass`): *collect* (each tile runs up to its core attention, which stores the tile's K/V and stops
the layer, :class:`ReplayStop`; the K/V are then gathered once), *attend* (each tile runs the whole layer
over the gathered K/V and backpropagates its share of the output gradient) and *K/V gradients* (dK/dV
reduce-scattered to their owners, each tile backpropagated from its core attention).  The attention takes
part through the :class:`ReplayPort` it holds as ``replay_port``.  Parameter gradients are summed over the
tiles and returned by one autograd node, so gradient hooks (Megatron's DDP) fire once per parameter.
Dropout is not replayed per tile (a tile would draw other masks than the whole layer): callers refuse it.
The algorithm and its memory: docs/memory-features.md (``--longctx-recompute-tiles``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
from torch.utils import _pytree as pytree

from megatron_longctx.memory import grad_buffers, hooks, residual_offload
from megatron_longctx.memory.recompute import RngRewind, RngSnapshot


class Pass(enum.Enum):
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


class RangeStack(Protocol):
    """A profiler's stack of open ranges (Megatron's NVTX ranges): a tile stopped by :class:`ReplayStop`
    leaves the ranges the layer pushed before its core attention open; the replay pops them."""

    def depth(self) -> int:
        """How many ranges are open."""

    def pop_to(self, depth: int) -> None:
        """Close the innermost ranges until ``depth`` are open."""


@dataclasses.dataclass
class Replay:
    """One layer's replay: the pass, the tile being run, and the attention's state."""

    seq_len: int  # this rank's tokens
    mode: Pass = Pass.COLLECT
    lo: int = 0
    hi: int = 0
    state: Any = None

    def state_for(self, make: Callable[[], Any]) -> Any:
        """The attention's state for this layer (its K/V store, :class:`~megatron_longctx.attention.tiled.
        TiledKV` or the like), made on first use."""
        if self.state is None:
            self.state = make()
        return self.state

    def step(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The attention's share of this pass for the tile's ``query``/``key``/``value``: store K/V and stop
        the layer (collect), attend over the gathered K/V (attend), or stop with the tile's K/V and their
        gradients (K/V gradients)."""
        kv = self.state
        if self.mode is Pass.COLLECT:
            kv.store(self.lo, self.hi, key, value)
            raise ReplayStop()
        if self.mode is Pass.KV_GRAD:
            raise ReplayStop((key, value), kv.kv_grads(self.lo, self.hi, key.dtype))
        return kv.attend(query, self.lo, self.hi)


class ReplayPort:
    """Held by an attention module as ``replay_port``: the replay handed in for the pass in progress
    (:attr:`replay`, ``None`` outside one).  A collaborator, so the attention inherits nothing from here.

    For each pass the replay is handed in through :meth:`replaying`; the attention then runs
    :meth:`Replay.step` on its tile (``lo``, ``hi``) with the per-layer state it keeps in
    :meth:`Replay.state_for` (:class:`megatron_longctx.megatron.core_attention.ContextParallelAttention`
    holds one port).
    """

    def __init__(self) -> None:
        self.replay: Optional[Replay] = None

    @contextlib.contextmanager
    def replaying(self, replay: Replay) -> Iterator[None]:
        before, self.replay = self.replay, replay
        try:
            yield
        finally:
            self.replay = before


def replay_port_of(layer: Any) -> ReplayPort:
    """The one :class:`ReplayPort` inside ``layer`` (a module's ``replay_port``), which the replay is handed to."""
    found = [port for m in layer.modules() if isinstance(port := getattr(m, "replay_port", None), ReplayPort)]
    if not found:
        raise ValueError("--longctx-recompute-tiles: the layer has no attention that takes part in a tiled replay; "
                         "build the model with megatron_longctx.apply_to_spec (ContextParallelAttention as "
                         "core_attention) or set --longctx-recompute-tiles 0")
    if len(found) > 1:
        raise ValueError("--longctx-recompute-tiles: a tiled layer holds more than one core attention; "
                         "tile layers with one self-attention only, or set --longctx-recompute-tiles 0")
    return found[0]


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
    port: ReplayPort  # the layer's attention's port, through which each pass hands it the replay
    grad_target: Optional[residual_offload.Target] = None  # --longctx-offload-residual-grad: where dx may stream
    output_over_input: bool = False  # --longctx-tiled-output-over-input
    out_spec: Any = None
    token_slots: Optional[list] = None  # output leaves with one row per token (concatenated over tiles)
    other_leaves: Optional[list] = None  # the remaining output leaves, as the first tile returned them
    ranges: Optional[RangeStack] = None  # ranges the layer opens, closed when a tile stops mid-layer

    def run_tile(self, x_t: torch.Tensor, lo: int, hi: int) -> Any:
        kwargs = {k: (_rows(v, lo, hi) if k in PER_TOKEN_KWARGS else v) for k, v in self.kwargs.items()}
        depth = self.ranges.depth() if self.ranges is not None else 0
        try:
            if self.positional:
                return self.fn(x_t, *self.rest, **kwargs)
            return self.fn(hidden_states=x_t, **kwargs)
        except ReplayStop:
            if self.ranges is not None:
                self.ranges.pop_to(depth)  # what the stopped tile pushed (the layer's and its attention's)
            raise


def _rows(value: Any, lo: int, hi: int) -> Any:
    """Rows ``[lo, hi)`` (dim 0) of every tensor in ``value`` (a tensor, a tuple of them, or None)."""
    return pytree.tree_map(lambda t: t[lo:hi] if isinstance(t, torch.Tensor) else t, value)


Rows = Callable[[int, int, Optional[tuple]], torch.Tensor]  # rows [lo, hi) of the layer input; the rows read next


def _with_next(tiles: list) -> list:
    """``[((lo, hi), the next tile or None), ...]``: a tile's reader may start fetching the next one."""
    return list(zip(tiles, [*tiles[1:], None]))


def _collect(call: _TiledCall, rows: Rows, seq_len: int, with_grads: bool) -> Replay:
    """Pass 1: every tile's K/V stored by the core attention, then gathered."""
    replay = Replay(seq_len=seq_len)
    with torch.no_grad(), call.port.replaying(replay):
        for (lo, hi), ahead in _with_next(tile_bounds(seq_len, call.num_tiles)):
            replay.lo, replay.hi = lo, hi
            try:
                call.run_tile(rows(lo, hi, ahead), lo, hi)
            except ReplayStop:
                continue
            raise ValueError("--longctx-recompute-tiles: the layer ran to its end without reaching its attention; "
                             "replay layers whose attention runs on every call, or set --longctx-recompute-tiles 0")
    replay.state.gather(with_grads)
    return replay


def _forward(call: _TiledCall, x: torch.Tensor,
             over_input: Optional[Callable[[], None]] = None) -> list[torch.Tensor]:
    """Passes 1 and 2 without gradients: the layer's outputs, one tile at a time.

    ``over_input``: the first output, when it has the input's shape and dtype, is written over ``x``
    (each tile's rows once the tile has run; pass 1 has read every row before); called once before the
    first write, it returns when ``x``'s memory may be overwritten."""
    replay = _collect(call, lambda lo, hi, ahead: x[lo:hi], x.shape[0], with_grads=False)
    replay.mode = Pass.ATTEND
    outs: list[torch.Tensor] = []
    with torch.no_grad(), call.port.replaying(replay):
        for lo, hi in tile_bounds(x.shape[0], call.num_tiles):
            replay.lo, replay.hi = lo, hi
            leaves, spec = pytree.tree_flatten(call.run_tile(x[lo:hi], lo, hi))
            if call.token_slots is None:
                call.out_spec = spec
                call.token_slots = [i for i, o in enumerate(leaves)
                                    if isinstance(o, torch.Tensor) and o.dim() > 0 and o.shape[0] == hi - lo]
                call.other_leaves = [None if i in call.token_slots else o for i, o in enumerate(leaves)]
                outs = [leaves[i].new_empty((x.shape[0], *leaves[i].shape[1:])) if j or over_input is None
                        or (leaves[i].shape[1:], leaves[i].dtype) != (x.shape[1:], x.dtype) else None
                        for j, i in enumerate(call.token_slots)]
                if outs and outs[0] is None:
                    over_input()
                    outs[0] = x
            for out, i in zip(outs, call.token_slots):
                out[lo:hi] = leaves[i]
    replay.state.release()
    return outs


class _OutputGrad:
    """One output's gradient, read a tile of rows at a time: a tensor, a stream, or a stream plus the
    gradient autograd added to it (:mod:`residual_offload`)."""

    def __init__(self, dense: Optional[torch.Tensor], stream: Optional[residual_offload.ResidualGradOffload]) -> None:
        self.dense, self.stream = dense, stream

    def rows(self, lo: int, hi: int, ahead: Optional[tuple] = None) -> torch.Tensor:
        if self.stream is None:
            return self.dense[lo:hi]
        rows = self.stream.read(lo, hi, ahead)
        return rows if self.dense is None else rows.add_(self.dense[lo:hi])


class _InputGrad:
    """Where the layer input's gradient goes: pass 2 puts each tile's rows, pass 3 adds the K/V path's.

    ``dense``: a device buffer (it may be the output gradient's, :mod:`grad_buffers`).  ``stream``: pass 2
    writes the rows there instead (in place of the output gradient's rows when that stream came in);
    ``onward``: pass 3 leaves them there for the next backward, else it moves them into a device buffer
    made only then, once the gathered K/V and dK/dV are gone.
    """

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                 dense: Optional[torch.Tensor] = None, stream: Optional[residual_offload.ResidualGradOffload] = None,
                 onward: bool = False) -> None:
        self.like = (shape, dtype, device)
        self.dense, self.stream, self.onward = dense, stream, onward

    def put(self, lo: int, hi: int, rows: Optional[torch.Tensor]) -> None:
        if self.stream is not None:
            shape, dtype, device = self.like
            self.stream.write(lo, hi, rows if rows is not None
                              else torch.zeros((hi - lo, *shape[1:]), dtype=dtype, device=device))
        elif rows is not None:
            self.dense[lo:hi] = rows
        else:
            self.dense[lo:hi].zero_()

    def begin_kv_pass(self) -> None:
        if self.stream is not None and not self.onward:
            shape, dtype, device = self.like
            self.dense = torch.empty(shape, dtype=dtype, device=device)

    def add(self, lo: int, hi: int, rows: Optional[torch.Tensor], ahead: Optional[tuple] = None) -> None:
        if self.stream is None:
            if rows is not None:
                self.dense[lo:hi] += rows
        elif self.onward:
            if rows is not None:
                self.stream.write(lo, hi, self.stream.read(lo, hi, ahead).add_(rows))
        else:
            self.dense[lo:hi] = (self.stream.read(lo, hi, ahead) if rows is None
                                 else self.stream.read(lo, hi, ahead).add_(rows))


def _backward(call: _TiledCall, rows: Rows, dx: _InputGrad, params: tuple, grads: list) -> list:
    """Passes 1-3 with gradients into ``dx``; returns the parameter gradients.

    ``rows(lo, hi)`` gives the layer input's rows, read again in every pass (an offloaded input comes
    back one tile at a time); ``grads``: the outputs' gradients (:class:`_OutputGrad` or ``None``).  Pass 2
    writes every tile's rows of ``dx`` after the tile's rows of the output gradient are consumed, so
    ``dx`` may be that gradient's buffer (:mod:`grad_buffers`) or stream."""
    seq_len = dx.like[0][0]
    replay = _collect(call, rows, seq_len, with_grads=True)
    dparams = grad_buffers.ParamGrads(params)
    tiles = tile_bounds(seq_len, call.num_tiles)
    replay.mode = Pass.ATTEND
    for (lo, hi), ahead in _with_next(tiles):
        replay.lo, replay.hi = lo, hi
        x_t = rows(lo, hi, ahead).detach().requires_grad_(True)
        with torch.enable_grad(), call.port.replaying(replay):
            leaves = pytree.tree_leaves(call.run_tile(x_t, lo, hi))
        outs, out_grads = [], []
        for i, g in zip(call.token_slots, grads):
            if g is not None and leaves[i].requires_grad:
                outs.append(leaves[i])
                out_grads.append(g.rows(lo, hi, ahead))
        got = dparams.grad(outs, (x_t,), out_grads) if outs else (None,)
        dx.put(lo, hi, got[0])
        del leaves, outs, out_grads, got
    replay.state.reduce_grads()
    dx.begin_kv_pass()
    replay.mode = Pass.KV_GRAD
    for (lo, hi), ahead in _with_next(tiles):
        replay.lo, replay.hi = lo, hi
        x_t = rows(lo, hi, ahead).detach().requires_grad_(True)
        try:
            with torch.enable_grad(), call.port.replaying(replay):
                call.run_tile(x_t, lo, hi)
        except ReplayStop as stop:
            got = dparams.grad(stop.outputs, (x_t,), stop.grads)
        else:
            raise RuntimeError("tiled replay: the layer did not stop at its core attention in the K/V pass")
        dx.add(lo, hi, got[0], ahead)
        del got
    replay.state.release()
    return dparams.result()


@residual_offload.reads_streams
class TiledCheckpointFunction(torch.autograd.Function):
    """Keeps the layer input and replays the layer in tiles.

    An offload packer that serves row ranges (:func:`hooks.pack_rows`: the checkpoint offload) takes the
    input, and backward reads it back one tile at a time, never whole; otherwise it is saved with
    ``save_for_backward`` (any outer packer sees it as usual).  The output gradients may come as
    streams and the input's may leave as one (:mod:`residual_offload`).
    """

    @staticmethod
    def forward(ctx, call: _TiledCall, x: torch.Tensor, *params: torch.Tensor):  # type: ignore[override]
        ctx.call, ctx.params = call, params
        ctx.rows_item = hooks.pack_rows(x)
        ctx.input_like = (x.shape, x.dtype, x.device)
        ctx.watch = grad_buffers.Watch(x)
        ctx.consumer = residual_offload.consumer_of(x, ctx.watch) if call.grad_target is not None else None
        if ctx.rows_item is None:
            ctx.save_for_backward(x)
        # the output over the input's memory: only once its values are safe off the device, and only in a
        # tensor that is autograd's own (not a leaf, not a view of another tensor)
        over_input = (call.output_over_input and ctx.rows_item is not None
                      and hasattr(ctx.rows_item[0], "wait_stored") and x.grad_fn is not None
                      and x._base is None and x.is_contiguous())
        with hooks.paused():
            outs = _forward(call, x.detach(), (lambda: hooks.wait_stored(ctx.rows_item)) if over_input else None)
        if outs and outs[0].data_ptr() == x.data_ptr():
            ctx.mark_dirty(x)
            outs[0] = x
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        item, ctx.rows_item = ctx.rows_item, None  # the offloaded copy is released with this backward
        if item is None:
            x = ctx.saved_tensors[0].detach()
            rows: Rows = lambda lo, hi, ahead: x[lo:hi]  # noqa: E731
        else:
            rows = functools.partial(hooks.unpack_rows, item)
        shape, dtype, device = ctx.input_like
        taken = [residual_offload.take(ctx, slot, g) for slot, g in enumerate(grads)]
        out_grads = [None if stream is None and g is None else _OutputGrad(g, stream) for stream, g in taken]
        stream_in, added = taken[0] if len(taken) == 1 else (None, None)
        onward = ctx.consumer is not None and ctx.watch.private()
        if stream_in is not None and added is None and (stream_in.shape, stream_in.dtype) == (shape, dtype):
            dx = _InputGrad(shape, dtype, device, stream=stream_in, onward=onward)  # in place of the output's rows
        elif onward:
            dx = _InputGrad(shape, dtype, device, stream=ctx.call.grad_target.new(shape, dtype, device), onward=True)
        elif len(grads) == 1 and stream_in is None and grad_buffers.reusable(grads[0], shape, dtype, device):
            # the input's gradient in the output gradient's buffer when that is a plugin's own and the only one
            dx = _InputGrad(shape, dtype, device, dense=grads[0])
        else:
            dx = _InputGrad(shape, dtype, device, dense=torch.empty(shape, dtype=dtype, device=device))
        del grads, taken
        with RngRewind(ctx.call.rng), hooks.paused():
            dparams = _backward(ctx.call, rows, dx, ctx.params, out_grads)
        if dx.onward:
            return (None, residual_offload.hand_over(ctx.consumer, dx.stream), *dparams)
        return (None, grad_buffers.own(dx.dense, ctx.watch), *dparams)


def tiled_checkpoint(fn: Callable, num_tiles: int, params: Callable[[], Any], *args: Any, port: ReplayPort,
                     grad_target: Optional[residual_offload.Target] = None, output_over_input: bool = False,
                     ranges: Optional[RangeStack] = None, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` (a transformer layer) kept as its input and replayed in ``num_tiles`` tiles.

    The first argument (or ``hidden_states``) is ``[s, b, h]``, cut along ``s``; the rotary
    embeddings (:data:`PER_TOKEN_KWARGS`) are cut with it; ``params()`` gives the layer's parameters;
    ``port``: the layer's attention's :class:`ReplayPort` (:func:`replay_port_of`).
    Every tensor output with one row per token is concatenated over the tiles; other outputs come
    from the first tile.  ``grad_target``: the input's gradient may stream there (:mod:`residual_offload`).
    ``output_over_input``: the first output is written over the input's memory when the checkpoint
    offload holds the input's values (an in-place op on the input, as ``x.add_(...)``: the caller's
    tensor then holds the output).  ``ranges``: the profiler ranges ``fn`` opens (Megatron's NVTX stack),
    closed again when a tile stops at the core attention.  Without grad mode this is ``fn(*args, **kwargs)``.
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
                      rng=RngSnapshot.capture(), port=port, grad_target=grad_target,
                      output_over_input=output_over_input, ranges=ranges)
    trainable = tuple(p for p in params() if p.requires_grad)
    outs = TiledCheckpointFunction.apply(call, x, *trainable)
    leaves = list(call.other_leaves)
    for slot, o in zip(call.token_slots, outs):
        leaves[slot] = o
    return pytree.tree_unflatten(leaves, call.out_spec)
