"""Tiled logits + (vocab-parallel) cross-entropy: never materialise ``[s, b, V]`` logits.

The output projection and the loss run over sequence tiles, and each tile's backward runs inside the
forward while its logits are at hand (ALST's ``TiledFusedLogitsLoss`` does the same, arXiv:2506.13996):
three matmuls per tile (logits, ``D @ W``, ``D^T h`` with ``D = softmax - onehot``) instead of four
with a recompute in backward.  The loss is per token, so the incoming gradient ``g`` ``[s, b]`` is
only known in backward: ``d hidden = g · (D @ W)`` is exact for any ``g``; ``d W = Σ_t g_t D_t^T h_t``
is kept as ``A = Σ_t D_t^T h_t`` and scaled by ``c``, the most common value of ``g`` (Megatron's loss:
``loss_mask / tokens``), and the tokens whose ``g`` differs (masked ones) are recomputed in backward
and added as ``Σ_t (g_t - c) D_t^T h_t``.  Forward keeps ``D @ W`` ``[s, b, h]``, ``A`` ``[V/tp, h]``
float32, the hidden states and the log-sum-exp ``[s, b]``.  Same loss and gradients as Megatron's
``output_layer`` + ``vocab_parallel_cross_entropy`` (vocab split over TP; a CP rank simply owns its
tokens); the vocab-parallel softmax is Megatron's (Shoeybi et al. 2019, arXiv:1909.08053).

With ``recompute`` (``--longctx-tiled-loss-recompute``) forward keeps only the hidden states and the
log-sum-exp, and backward recomputes each tile's logits (four matmuls per tile): no ``[s, b, h]`` and no
``[V/tp, h]`` float32 buffer lives from forward to backward, and the output weight's gradient goes
straight into Megatron's ``main_grad`` (its gradient-accumulation-fusion protocol) when the weight is
the output layer's own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_longctx.memory import grad_buffers, residual_offload


@dataclasses.dataclass(frozen=True)
class TiledLossArgs:
    """How :func:`tiled_logits_loss` runs (``ValueError`` naming the flag for a bad value).

    num_tiles: sequence tiles; peak extra memory is one ``[s/num_tiles, b, V/tp]`` float32 tile (each tile's
        buffer is released before the next tile's is allocated), and ``[s, b, h]`` + ``[V/tp, h]`` float32
        held from forward to backward.
    tp_group: the vocab-parallel (tensor-parallel) group; None or size 1: the whole vocabulary here.
    reduce_grad_input: all-reduce ``d hidden`` over ``tp_group`` (hidden replicated, as in a
        ColumnParallelLinear without sequence parallel); False when the caller's gather reduces it.
    recompute: keep only ``hidden`` and the log-sum-exp from forward; backward recomputes each tile's logits
        (one more matmul per tile, no ``[s, b, h]`` / ``[V/tp, h]`` buffers held in between).
    into_main_grad: with ``recompute``, the weight's gradient accumulates into its Megatron ``main_grad`` (set
        only for a weight no other module uses: a tied embedding's own gradient would be skipped by
        Megatron's hook); ignored without it.
    norm: with ``recompute``, a token-wise norm module applied to ``hidden`` first, one tile at a time in
        forward and again in backward: its ``[s, b, h]`` output is never kept (``hidden`` is the norm's
        input).  ``norm_forward`` calls it (default: the module itself).
    grad_target: with ``recompute``, the gradient of ``hidden`` goes there a tile at a time when the node that
        receives it reads streams (a tiled layer replay, :mod:`residual_offload`); ignored without it.
    """

    num_tiles: int
    tp_group: Any = None
    reduce_grad_input: bool = True
    recompute: bool = False
    into_main_grad: bool = False
    norm: Optional[torch.nn.Module] = None
    norm_forward: Optional[Callable] = None
    grad_target: Optional[residual_offload.Target] = None

    def __post_init__(self) -> None:
        if self.num_tiles < 1:
            raise ValueError(f"--longctx-tiled-loss-tiles: got {self.num_tiles}; give an integer >= 1")
        if self.norm is not None and not self.recompute:
            raise ValueError("tiled_logits_loss: a norm is applied per tile only with recompute=True "
                             "(--longctx-tiled-loss-recompute)")
        if not self.recompute:
            object.__setattr__(self, "into_main_grad", False)
            object.__setattr__(self, "grad_target", None)

    def apply_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return (self.norm_forward or self.norm)(hidden)  # type: ignore[misc]

    @property
    def norm_params(self) -> tuple:
        return () if self.norm is None else tuple(p for p in self.norm.parameters() if p.requires_grad)


def group_size_rank(group: Any) -> tuple[int, int]:
    """``(size, rank)`` of ``group``; ``(1, 0)`` for None or without torch.distributed."""
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _bounds(s: int, num_tiles: int) -> list[tuple[int, int]]:
    step = -(-s // num_tiles)
    return [(i, min(i + step, s)) for i in range(0, s, step)]


def _tile_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # [t, b, h] x [V/tp, h] -> [t, b, V/tp] float32
    logits = torch.matmul(hidden, weight.t())  # [t, b, V/tp]
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _softmax_minus_onehot(probs: torch.Tensor, target: torch.Tensor, v_start: int) -> torch.Tensor:
    """``probs - onehot(target)`` in place; ``probs`` ``[t, ..., V/tp]`` holds this rank's vocabulary slice."""
    v_local = probs.shape[-1]
    local = target - v_start  # [t, ...]
    in_range = (local >= 0) & (local < v_local)
    probs.scatter_add_(-1, local.clamp(0, v_local - 1).unsqueeze(-1), -in_range.unsqueeze(-1).to(probs.dtype))
    return probs


def _tile_loss(args: TiledLossArgs, h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, v_start: int,
               lse: torch.Tensor, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One tile's log-sum-exp and loss (written into ``lse``, ``loss`` ``[t, b]``); returns its
    ``exp(logits - max)`` ``[t, b, V/tp]`` (the tile's one logits buffer) and their sum ``[t, b]``."""
    tp, _ = group_size_rank(args.tp_group)
    v_local = weight.shape[0]
    logits = _tile_logits(h, weight)  # [t, b, V/tp]
    row_max = logits.max(dim=-1).values  # [t, b]
    if tp > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=args.tp_group)  # [t, b]
    local = target - v_start  # [t, b]
    in_range = (local >= 0) & (local < v_local)
    picked = logits.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)  # [t, b]
    picked = torch.where(in_range, picked, torch.zeros_like(picked))
    sum_exp = logits.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)  # [t, b], in place: one tile buffer
    if tp > 1:
        both = torch.stack([picked, sum_exp])  # [2, t, b]
        dist.all_reduce(both, group=args.tp_group)  # [2, t, b]
        picked, sum_exp = both[0], both[1]
    lse.copy_(row_max + torch.log(sum_exp))
    loss.copy_(lse - picked)
    return logits, sum_exp


def tiled_loss_forward(args: TiledLossArgs, hidden: torch.Tensor, weight: torch.Tensor,
                       target: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-token loss and log-sum-exp ``[s, b]`` (float32), ``D @ W`` ``[s, b, h]`` and ``D^T h`` ``[V/tp, h]``.

    ``target`` ``[s, b]``.  ``D @ W`` is this rank's share (summed over TP in backward).  With
    ``args.recompute`` the last two are ``None`` (backward recomputes them).
    """
    _, rank = group_size_rank(args.tp_group)
    v_local = weight.shape[0]
    v_start = rank * v_local
    acc = torch.promote_types(hidden.dtype, torch.float32)
    loss = torch.empty(target.shape, dtype=acc, device=hidden.device)  # [s, b]
    lse = torch.empty_like(loss)  # [s, b]
    d_hidden = d_weight = None
    if not args.recompute:
        d_hidden = torch.empty_like(hidden)  # [s, b, h]: D @ W, d loss_t / d hidden_t
        d_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                               device=weight.device)  # [V/tp, h]: sum_t D_t^T h_t
    for start, end in _bounds(hidden.shape[0], args.num_tiles):
        h = hidden[start:end]  # [t, b, h]
        if args.norm is not None:
            with torch.no_grad():
                h = args.apply_norm(h)  # [t, b, h]
        logits, sum_exp = _tile_loss(args, h, weight, target[start:end], v_start, lse[start:end], loss[start:end])
        if d_weight is None:  # recompute: the tile's backward runs in backward
            del logits
            continue
        # the tile's backward while its logits are here: D = softmax - onehot, in the same buffer
        grad_logits = _softmax_minus_onehot(logits.div_(sum_exp.unsqueeze(-1)), target[start:end], v_start)
        # D @ W in the hidden dtype (a low-precision copy of D, gone before D^T h); D^T h from the float32 D
        torch.matmul(grad_logits.to(hidden.dtype), weight, out=d_hidden[start:end])  # [t, b, h]
        d_weight.addmm_(grad_logits.reshape(-1, v_local).t(), h.reshape(-1, h.shape[-1]).to(d_weight.dtype))
        del logits, grad_logits  # this tile's [t, b, V/tp] buffer is gone before the next one is made
    return loss, lse, d_hidden, d_weight


def _most_common(values: torch.Tensor) -> torch.Tensor:
    """The value ``values`` takes most often (a 0-d tensor)."""
    uniq, counts = torch.unique(values.reshape(-1), return_counts=True)
    return uniq[counts.argmax()]


def tiled_loss_backward(args: TiledLossArgs, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                        saved: tuple[torch.Tensor, ...], grad_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``sum(grad_loss * loss)`` for ``hidden`` ``[s, b, h]`` and ``weight`` ``[V/tp, h]``.

    ``saved`` = (lse, D @ W, D^T h) from :func:`tiled_loss_forward`; ``grad_loss`` ``[s, b]`` float32.
    """
    tp, rank = group_size_rank(args.tp_group)
    lse, d_hidden, d_weight = saved
    grad_hidden = d_hidden.mul_(grad_loss.unsqueeze(-1).to(d_hidden.dtype))  # [s, b, h], exact for any g
    if args.reduce_grad_input and tp > 1:
        dist.all_reduce(grad_hidden, group=args.tp_group)  # [s, b, h]
    common = _most_common(grad_loss)
    grad_weight = d_weight.mul_(common)  # [V/tp, h]
    rows = (grad_loss != common).reshape(-1).nonzero().squeeze(-1)  # [r] tokens (flattened s·b) to correct
    if rows.numel():
        h_all = hidden.reshape(-1, hidden.shape[-1])  # [s·b, h]
        tile = max(1, -(-hidden.shape[0] // args.num_tiles) * hidden.shape[1])
        for start in range(0, rows.numel(), tile):
            idx = rows[start:start + tile]  # [r_t]
            h = h_all.index_select(0, idx)  # [r_t, h]
            probs = _tile_logits(h, weight).sub_(lse.reshape(-1)[idx].unsqueeze(-1)).exp_()  # [r_t, V/tp]
            grad_logits = _softmax_minus_onehot(probs, target.reshape(-1)[idx], rank * weight.shape[0])
            scale = (grad_loss.reshape(-1)[idx] - common).unsqueeze(-1)  # [r_t, 1]
            grad_weight.addmm_(grad_logits.t().to(grad_weight.dtype), (scale * h).to(grad_weight.dtype))  # [V/tp, h]
            del probs, grad_logits  # one [r_t, V/tp] tile alive at a time
    return grad_hidden, grad_weight.to(weight.dtype)


def _weight_grad_target(args: TiledLossArgs, weight: torch.Tensor) -> torch.Tensor:
    """Where the recompute backward accumulates ``d W`` (float32): the weight's Megatron ``main_grad``
    when allowed (:func:`grad_buffers.main_grad_of`), else a float32 buffer returned in the weight's dtype."""
    main = grad_buffers.main_grad_of(weight) if args.into_main_grad else None
    if main is not None:
        return main
    return torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32), device=weight.device)


def tiled_loss_backward_recompute(args: TiledLossArgs, hidden: torch.Tensor, weight: torch.Tensor,
                                  target: torch.Tensor, lse: torch.Tensor, grad_loss: torch.Tensor,
                                  norm_params: tuple = (),
                                  stream: Optional[residual_offload.ResidualGradOffload] = None) -> tuple:
    """Gradients of ``sum(grad_loss * loss)`` with each tile's logits recomputed from ``hidden`` and ``lse``:
    ``(d hidden, d weight, *d norm_params)``.

    Exact for any ``grad_loss`` (each token's row of D is scaled by its own gradient).  With
    ``args.norm`` each tile's norm runs again and backpropagates its share into ``hidden`` (the norm's
    input) and ``norm_params``.  With ``stream`` the rows of ``d hidden`` are written there, one tile at a
    time, and it is returned in place of a tensor (:mod:`residual_offload`).
    """
    tp, rank = group_size_rank(args.tp_group)
    v_start = rank * weight.shape[0]
    grad_hidden = torch.empty_like(hidden) if stream is None else None  # [s, b, h]
    grad_weight = _weight_grad_target(args, weight)  # [V/tp, h] float32
    grad_norm = grad_buffers.ParamGrads(norm_params)
    for start, end in _bounds(hidden.shape[0], args.num_tiles):
        x = h = hidden[start:end]  # [t, b, h]
        if args.norm is not None:
            x = x.detach().requires_grad_(True)
            with torch.enable_grad():
                normed = args.apply_norm(x)  # [t, b, h]
            h = normed.detach()
        probs = _tile_logits(h, weight).sub_(lse[start:end].unsqueeze(-1)).exp_()  # [t, b, V/tp]
        grad_logits = _softmax_minus_onehot(probs, target[start:end], v_start)
        grad_logits.mul_(grad_loss[start:end].unsqueeze(-1))  # [t, b, V/tp]: g_t D_t
        grad_h = grad_hidden[start:end] if args.norm is None and stream is None else torch.empty_like(h)  # [t, b, h]
        torch.matmul(grad_logits.to(hidden.dtype), weight, out=grad_h)  # [t, b, h]
        grad_weight.addmm_(grad_logits.reshape(-1, weight.shape[0]).t(),
                           h.reshape(-1, h.shape[-1]).to(grad_weight.dtype))  # [V/tp, h]
        del probs, grad_logits  # one [t, b, V/tp] tile alive at a time
        if args.norm is not None:
            (grad_h,) = grad_norm.grad(normed, (x,), grad_h)
            del normed
        if stream is not None:
            stream.write(start, end, grad_h)
        elif args.norm is not None:
            grad_hidden[start:end] = grad_h
        del grad_h
    if stream is not None:
        grad_hidden = stream
    elif args.reduce_grad_input and tp > 1:
        dist.all_reduce(grad_hidden, group=args.tp_group)  # [s, b, h]
    if grad_weight is getattr(weight, "main_grad", None):
        return (grad_hidden, grad_buffers.main_grad_placeholder(weight), *grad_norm.result())
    return (grad_hidden, grad_weight.to(weight.dtype), *grad_norm.result())


class TiledLogitsLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, args: TiledLossArgs, hidden: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                target: torch.Tensor, *norm_params: torch.Tensor) -> torch.Tensor:
        loss, lse, d_hidden, d_weight = tiled_loss_forward(args, hidden, weight, target)
        ctx.args, ctx.norm_params = args, norm_params
        ctx.watch = grad_buffers.Watch(hidden)
        tp = group_size_rank(args.tp_group)[0]
        streams = args.grad_target is not None and args.recompute and not (args.reduce_grad_input and tp > 1)
        ctx.consumer = residual_offload.consumer_of(hidden, ctx.watch) if streams else None
        if args.recompute:
            ctx.save_for_backward(hidden, weight, target, lse)
        else:
            ctx.save_for_backward(hidden, weight, target, lse, d_hidden, d_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        if ctx.args.recompute:
            hidden, weight, target, lse = ctx.saved_tensors
            stream = None
            if ctx.consumer is not None and ctx.watch.private():
                stream = ctx.args.grad_target.new(hidden.shape, hidden.dtype, hidden.device)
            grad_hidden, grad_weight, *grad_norm = tiled_loss_backward_recompute(
                ctx.args, hidden, weight, target, lse, grad_loss.to(lse.dtype), ctx.norm_params, stream)
            grad_hidden = (grad_buffers.own(grad_hidden, ctx.watch) if stream is None
                           else residual_offload.hand_over(ctx.consumer, stream))
            return None, grad_hidden, grad_weight, None, *grad_norm
        if getattr(ctx, "done", False):  # the saved D @ W and D^T h were scaled in place by the first backward
            raise RuntimeError("tiled logits+loss: a second backward through the same graph (retain_graph=True) is "
                               "not supported; run the forward again, set --longctx-tiled-loss-recompute, or set "
                               "--longctx-tiled-loss-tiles 0")
        ctx.done = True
        hidden, weight, target, lse, d_hidden, d_weight = ctx.saved_tensors
        grad_hidden, grad_weight = tiled_loss_backward(ctx.args, hidden, weight, target, (lse, d_hidden, d_weight),
                                                       grad_loss.to(lse.dtype))
        return None, grad_buffers.own(grad_hidden, ctx.watch), grad_weight, None


def tiled_logits_loss(hidden: torch.Tensor, output_weight: torch.Tensor, labels: torch.Tensor,
                      args: TiledLossArgs) -> torch.Tensor:
    """Cross-entropy of ``hidden @ output_weight.T`` against ``labels``, over ``args.num_tiles`` sequence tiles.

    Args:
        hidden: ``[s, b, h]`` final hidden states (this CP rank's tokens; full sequence under TP).
        output_weight: ``[V/tp, h]`` this TP rank's vocabulary rows (rank r owns rows ``r·V/tp ...``).
        labels: ``[b, s]`` token ids.
        args: how it is tiled, recomputed and reduced (:class:`TiledLossArgs`).
    Returns:
        per-token loss ``[b, s]`` float32, as Megatron's ``compute_language_model_loss``.
    """
    if hidden.dim() != 3 or labels.shape != (hidden.shape[1], hidden.shape[0]):
        raise ValueError(f"tiled_logits_loss: hidden must be [s, b, h] and labels [b, s]; got "
                         f"{tuple(hidden.shape)} and {tuple(labels.shape)}")
    target = labels.transpose(0, 1).contiguous()  # [s, b]
    loss = TiledLogitsLoss.apply(args, hidden, output_weight, target, *args.norm_params)  # [s, b]
    return loss.transpose(0, 1).contiguous()  # [b, s]
