"""Tiled logits + (vocab-parallel) cross-entropy: never materialise ``[s, b, V]`` logits.

The output projection and the loss run over sequence tiles; forward keeps only the per-token
log-sum-exp (``[s, b]`` float32) and backward recomputes one tile's logits at a time.  Same loss and
gradients as Megatron's ``output_layer`` + ``vocab_parallel_cross_entropy`` (vocab split over TP; a
CP rank simply owns its tokens).  ALST tiled logits+loss (arXiv:2506.13996); the vocab-parallel softmax
is Megatron's (Shoeybi et al. 2019, arXiv:1909.08053).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class TiledLossArgs:
    tp_group: Any  # vocab-parallel group (None or size 1: whole vocabulary here)
    num_tiles: int
    reduce_grad_input: bool  # hidden is replicated over tp_group: all-reduce its gradient


def _group_size_rank(group: Any) -> tuple[int, int]:
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


def tiled_loss_forward(args: TiledLossArgs, hidden: torch.Tensor, weight: torch.Tensor,
                       target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss ``[s, b]`` and log-sum-exp ``[s, b]`` (float32); ``target`` ``[s, b]``."""
    tp, rank = _group_size_rank(args.tp_group)
    v_local = weight.shape[0]
    v_start = rank * v_local
    loss = torch.empty(target.shape, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)  # [s, b]
    lse = torch.empty_like(loss)  # [s, b]
    for start, end in _bounds(hidden.shape[0], args.num_tiles):
        logits = _tile_logits(hidden[start:end], weight)  # [t, b, V/tp]
        row_max = logits.max(dim=-1).values  # [t, b]
        if tp > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=args.tp_group)  # [t, b]
        local = target[start:end] - v_start  # [t, b]
        in_range = (local >= 0) & (local < v_local)
        picked = logits.gather(-1, local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)  # [t, b]
        picked = torch.where(in_range, picked, torch.zeros_like(picked))
        sum_exp = logits.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)  # [t, b], in place: one tile buffer
        if tp > 1:
            both = torch.stack([picked, sum_exp])  # [2, t, b]
            dist.all_reduce(both, group=args.tp_group)  # [2, t, b]
            picked, sum_exp = both[0], both[1]
        lse[start:end] = row_max + torch.log(sum_exp)
        loss[start:end] = lse[start:end] - picked
    return loss, lse


def tiled_loss_backward(args: TiledLossArgs, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                        lse: torch.Tensor, grad_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``sum(grad_loss * loss)`` for ``hidden`` ``[s, b, h]`` and ``weight`` ``[V/tp, h]``."""
    tp, rank = _group_size_rank(args.tp_group)
    v_local = weight.shape[0]
    v_start = rank * v_local
    grad_hidden = torch.empty_like(hidden)  # [s, b, h]
    grad_weight = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32), device=weight.device)  # [V/tp, h]
    for start, end in _bounds(hidden.shape[0], args.num_tiles):
        h = hidden[start:end]  # [t, b, h]
        # softmax - onehot(target), scaled by the incoming gradient, all in one tile buffer
        probs = _tile_logits(h, weight).sub_(lse[start:end].unsqueeze(-1)).exp_()  # [t, b, V/tp]
        local = target[start:end] - v_start  # [t, b]
        in_range = (local >= 0) & (local < v_local)
        probs.scatter_add_(-1, local.clamp(0, v_local - 1).unsqueeze(-1), -in_range.unsqueeze(-1).to(probs.dtype))
        grad_logits = probs.mul_(grad_loss[start:end].unsqueeze(-1)).to(hidden.dtype)  # [t, b, V/tp]
        grad_hidden[start:end] = torch.matmul(grad_logits, weight)  # [t, b, h]
        grad_weight += torch.einsum("tbv,tbh->vh", grad_logits, h).to(grad_weight.dtype)  # [V/tp, h]
    if args.reduce_grad_input and tp > 1:
        dist.all_reduce(grad_hidden, group=args.tp_group)  # [s, b, h]
    return grad_hidden, grad_weight.to(weight.dtype)


class TiledLogitsLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, args: TiledLossArgs, hidden: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                target: torch.Tensor) -> torch.Tensor:
        loss, lse = tiled_loss_forward(args, hidden, weight, target)
        ctx.args = args
        ctx.save_for_backward(hidden, weight, target, lse)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        hidden, weight, target, lse = ctx.saved_tensors
        grad_hidden, grad_weight = tiled_loss_backward(ctx.args, hidden, weight, target, lse, grad_loss.to(lse.dtype))
        return None, grad_hidden, grad_weight, None


def tiled_logits_loss(hidden: torch.Tensor, output_weight: torch.Tensor, labels: torch.Tensor, tp_group: Any,
                      num_tiles: int, *, reduce_grad_input: bool = True) -> torch.Tensor:
    """Cross-entropy of ``hidden @ output_weight.T`` against ``labels``, over ``num_tiles`` sequence tiles.

    Args:
        hidden: ``[s, b, h]`` final hidden states (this CP rank's tokens; full sequence under TP).
        output_weight: ``[V/tp, h]`` this TP rank's vocabulary rows (rank r owns rows ``r·V/tp ...``).
        labels: ``[b, s]`` token ids.
        tp_group: the vocab-parallel (tensor-parallel) group, or None.
        num_tiles: sequence tiles; peak extra memory is one ``[s/num_tiles, b, V/tp]`` float32 tile.
        reduce_grad_input: all-reduce ``d hidden`` over ``tp_group`` (hidden replicated, as in a
            ColumnParallelLinear without sequence parallel); False when the caller's gather reduces it.
    Returns:
        per-token loss ``[b, s]`` float32, as Megatron's ``compute_language_model_loss``.
    """
    if num_tiles < 1:
        raise ValueError(f"--longctx-tiled-loss-tiles: got {num_tiles}; give an integer >= 1")
    if hidden.dim() != 3 or labels.shape != (hidden.shape[1], hidden.shape[0]):
        raise ValueError(f"tiled_logits_loss: hidden must be [s, b, h] and labels [b, s]; got "
                         f"{tuple(hidden.shape)} and {tuple(labels.shape)}")
    args = TiledLossArgs(tp_group=tp_group, num_tiles=num_tiles, reduce_grad_input=reduce_grad_input)
    target = labels.transpose(0, 1).contiguous()  # [s, b]
    loss = TiledLogitsLoss.apply(args, hidden, output_weight, target)  # [s, b]
    return loss.transpose(0, 1).contiguous()  # [b, s]


# -------------------------------------------------------------------------------- GPTModel wiring


def _labels_of(signature: inspect.Signature, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return None
    return bound.arguments.get("labels")


def install_tiled_loss(gpt_model: torch.nn.Module, num_tiles: int) -> Callable[[], None]:
    """Make ``gpt_model(..., labels=...)`` compute its loss with :func:`tiled_logits_loss`.

    During a forward with labels, the model's ``output_layer`` hands the final hidden states through
    (gathered over TP when sequence parallel) and ``compute_language_model_loss`` runs the tiled loss
    with the same output weight (shared embedding or ``output_layer.weight``); parameters and
    ``state_dict`` keys stay the same.  Forward without labels is untouched (it returns logits).
    Returns the function that undoes it.
    """
    config = getattr(gpt_model, "config", None)
    if getattr(config, "use_mup", False):
        raise ValueError("--longctx-tiled-loss-tiles: MuP output scaling is not supported by the tiled loss; "
                         "set it to 0 or disable use_mup")
    if getattr(config, "mtp_num_layers", None):
        raise ValueError("--longctx-tiled-loss-tiles: multi-token prediction is not supported by the tiled "
                         "loss; set it to 0 or mtp_num_layers=None")
    if not hasattr(gpt_model, "output_layer") or not hasattr(gpt_model, "compute_language_model_loss"):
        raise ValueError("--longctx-tiled-loss-tiles: the model has no output_layer/compute_language_model_loss "
                         "(not a Megatron GPTModel post-process stage)")
    original_forward = gpt_model.forward
    signature = inspect.signature(original_forward)
    output_layer = gpt_model.output_layer

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if _labels_of(signature, args, kwargs) is None:
            return original_forward(*args, **kwargs)
        seen: dict = {}

        def pass_hidden(hidden: torch.Tensor, weight: Optional[torch.Tensor] = None, **_: Any) -> tuple:
            seen["weight"] = output_layer.weight if weight is None else weight
            seen["reduce"] = True
            if getattr(output_layer, "sequence_parallel", False):
                from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

                hidden = gather_from_sequence_parallel_region(hidden, group=output_layer.tp_group)  # [s, b, h]
                seen["reduce"] = False
            return hidden, None

        def loss(labels: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
            return tiled_logits_loss(hidden, seen["weight"], labels, getattr(output_layer, "tp_group", None),
                                     num_tiles, reduce_grad_input=seen["reduce"])

        output_layer.forward = pass_hidden
        gpt_model.compute_language_model_loss = loss
        try:
            return original_forward(*args, **kwargs)
        finally:
            output_layer.__dict__.pop("forward", None)
            gpt_model.__dict__.pop("compute_language_model_loss", None)

    gpt_model.forward = forward

    def remove() -> None:
        if gpt_model.__dict__.get("forward") is forward:
            del gpt_model.__dict__["forward"]

    return remove
