"""The tiled logits + loss (:mod:`megatron_longctx.memory.tiled_loss`) inside Megatron's ``GPTModel``.

During a forward with labels the model's ``output_layer`` hands the final hidden states through and
``compute_language_model_loss`` runs the tiled loss with the same output weight; parameters and
``state_dict`` keys stay Megatron's.  Every replacement is a :func:`megatron_longctx.patching.patch`.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch

from megatron_longctx.memory import residual_offload
from megatron_longctx.memory.tiled_loss import TiledLossArgs, group_size_rank, tiled_logits_loss
from megatron_longctx.patching import patch


def _labels_of(signature: inspect.Signature, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return None
    return bound.arguments.get("labels")


def _pass_through(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


def _check_model(gpt_model: torch.nn.Module) -> None:
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


def install_tiled_loss(gpt_model: torch.nn.Module, num_tiles: int, recompute: bool = False,
                       grad_target: Optional[residual_offload.Target] = None) -> Callable[[], None]:
    """Make ``gpt_model(..., labels=...)`` compute its loss with :func:`tiled_logits_loss`.

    Arguments:
        gpt_model: a Megatron ``GPTModel`` post-process stage.
        num_tiles: sequence tiles of the loss.
        recompute: see :func:`tiled_logits_loss`; an untied output weight's gradient then goes into its
            ``main_grad``, and without tensor parallelism the decoder's final norm runs inside the loss,
            tile by tile (the decoder returns the norm's input).
        grad_target: where the hidden states' gradient may stream (``--longctx-offload-residual-grad``).
    Returns:
        the function that undoes it. A forward without labels is untouched (it returns logits).
    """
    _check_model(gpt_model)
    original_forward = gpt_model.forward
    signature = inspect.signature(original_forward)
    output_layer = gpt_model.output_layer
    # Recompute: the decoder's final norm runs inside the loss, one tile at a time (its output is never
    # kept whole), where the hidden states are whole on this rank (no vocabulary split over TP).
    final_norm = getattr(getattr(gpt_model, "decoder", None), "final_layernorm", None) if recompute else None
    if final_norm is not None and (group_size_rank(getattr(output_layer, "tp_group", None))[0] > 1
                                   or getattr(output_layer, "sequence_parallel", False)):
        final_norm = None

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        labels = _labels_of(signature, args, kwargs)
        if labels is None:
            return original_forward(*args, **kwargs)
        seen: dict = {}
        norm_forward = None if final_norm is None else final_norm.forward  # the norm's own (or lean) forward

        def tiled(labels: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
            args = TiledLossArgs(num_tiles, getattr(output_layer, "tp_group", None), reduce_grad_input=seen["reduce"],
                                 recompute=recompute, into_main_grad=seen["own_weight"], norm=final_norm,
                                 norm_forward=norm_forward, grad_target=grad_target)
            return tiled_logits_loss(hidden, seen["weight"], labels, args)

        def pass_hidden(hidden: torch.Tensor, weight: Optional[torch.Tensor] = None, **_: Any) -> tuple:
            seen["weight"] = output_layer.weight if weight is None else weight
            seen["own_weight"] = weight is None  # not the shared embedding
            seen["reduce"] = True
            if getattr(output_layer, "sequence_parallel", False):
                from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

                hidden = gather_from_sequence_parallel_region(hidden, group=output_layer.tp_group)  # [s, b, h]
                seen["reduce"] = False
            # The loss is the output layer's output: whatever brings the layer's weights in for its call (the
            # model-state streamer) has them in for the logits, and brings them in again for the loss's
            # backward, which starts at this output.  With recompute the final norm runs here too, per tile
            # (its own call passed the hidden states through): the streamer keeps it in the output's unit.
            seen["loss"] = tiled(labels, hidden)
            return seen["loss"], None

        def loss(labels: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
            return output if "loss" in seen else tiled(labels, output)

        with patch(output_layer, "forward", pass_hidden, "tiled loss: the output layer hands the hidden states on"), \
                patch(gpt_model, "compute_language_model_loss", loss, "tiled loss: logits and loss per tile"):
            if final_norm is None:
                return original_forward(*args, **kwargs)
            with patch(final_norm, "forward", _pass_through, "tiled loss: the final norm runs inside the loss"):
                return original_forward(*args, **kwargs)

    return patch(gpt_model, "forward", forward, "tiled loss: labels go to the tiled logits + loss").undo
