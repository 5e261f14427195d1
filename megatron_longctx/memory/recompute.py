"""Activation recompute, device-agnostic: full (uniform/block) and selective per named module.

Full recompute keeps only a layer's inputs and reruns the layer in backward (Chen et al. 2016,
arXiv:1604.06174; Korthikanti et al. 2022, arXiv:2205.05198 for the Megatron granularities).  The
inputs are stored with ``ctx.save_for_backward``, so an outer offload packer sees them: recompute
everything, save and offload only the layer input (ALST checkpoint offload, arXiv:2506.13996).

RNG: the CPU generator, the current CUDA generator (when CUDA is initialised) and Megatron's
``get_cuda_rng_tracker()`` states are captured before the forward and restored around the replay, so
dropout masks replay exactly on either device.

Selective recompute names the parts as Megatron users do (``core_attn``, ``qkv``, ``proj``, ``mlp``,
``layernorm``).  A module's forward is wrapped in :func:`checkpoint`; outputs that are parameters (the
MLP's returned bias under ``add_bias_linear=True``) bypass the autograd Function, which is what sends
Megatron's version into endless recursion.  ``layernorm`` drops the norm's *output* (the tensor its
consumer saves) and recomputes it when backward first asks for it, through a saved-tensor packer; no
Transformer Engine needed.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree

from megatron_longctx.memory import hooks
from megatron_longctx.patching import patch

# ---------------------------------------------------------------------------------------------- RNG


@dataclasses.dataclass(frozen=True)
class RngSnapshot:
    """Every generator a replay has to rewind: CPU, current CUDA device, Megatron's tracker."""

    cpu: torch.Tensor
    cuda: Optional[torch.Tensor]
    tracker: Optional[dict]

    @staticmethod
    def capture() -> "RngSnapshot":
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        tracker = _tracker()
        states = None
        if tracker is not None:
            states = {k: (v.get_state() if isinstance(v, torch.Generator) else v.clone())
                      for k, v in tracker.get_states().items()}
        # The CPU state last: under cpu_compat the CUDA functions read the CPU generator too.
        return RngSnapshot(cpu=torch.get_rng_state(), cuda=cuda, tracker=states)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)
        tracker = _tracker()
        if tracker is not None and self.tracker is not None:
            current = tracker.get_states()
            restored = {}
            for name, state in self.tracker.items():
                if isinstance(current.get(name), torch.Generator):
                    current[name].set_state(state)
                    restored[name] = current[name]
                else:
                    restored[name] = state.clone()
            tracker.set_states(restored)


def _tracker() -> Any:
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    except ImportError:
        return None
    return get_cuda_rng_tracker()


@dataclasses.dataclass
class RngRewind:
    """Context: rewind to ``snapshot`` for a replay, then put the live generators back."""

    snapshot: RngSnapshot
    live: Optional[RngSnapshot] = None

    def __enter__(self) -> None:
        self.live = RngSnapshot.capture()
        self.snapshot.restore()

    def __exit__(self, *exc: Any) -> None:
        assert self.live is not None
        self.live.restore()


# ------------------------------------------------------------------------------------- checkpoint


@dataclasses.dataclass
class _CheckpointedCall:
    """Non-tensor parts of one checkpointed call: the function, the argument tree, the RNG."""

    fn: Callable
    spec: Any  # pytree spec of (args, kwargs)
    leaves: list  # non-tensor leaves as is; tensor slots hold None
    tensor_slots: list
    rng: RngSnapshot
    out_spec: Any = None
    out_leaves: Optional[list] = None  # non-grad outputs returned outside the Function
    grad_slots: Optional[list] = None  # positions of outputs that went through the Function


def checkpoint_forward(call: _CheckpointedCall, tensors: tuple) -> list:
    """Run ``call.fn`` without building a graph; return the outputs that autograd has to track."""
    leaves = list(call.leaves)
    for slot, t in zip(call.tensor_slots, tensors):
        leaves[slot] = t.detach()
    args, kwargs = pytree.tree_unflatten(leaves, call.spec)
    # Megatron re-enables grad around bias-dropout-add; whatever that saves dies with this call,
    # so no packer (offload) should spend a copy on it.
    with torch.no_grad(), hooks.paused():
        out = call.fn(*args, **kwargs)
    out_leaves, call.out_spec = pytree.tree_flatten(out)
    call.grad_slots = [i for i, o in enumerate(out_leaves)
                       if isinstance(o, torch.Tensor) and not isinstance(o, torch.nn.Parameter)]
    call.out_leaves = [None if i in call.grad_slots else o for i, o in enumerate(out_leaves)]
    return [out_leaves[i] for i in call.grad_slots]


def checkpoint_backward(call: _CheckpointedCall, tensors: tuple, grads: tuple) -> tuple:
    """Replay the forward with the saved RNG and the saved inputs, backpropagate ``grads`` through it."""
    inputs = [t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else t
              for t in tensors]
    leaves = list(call.leaves)
    for slot, t in zip(call.tensor_slots, inputs):
        leaves[slot] = t
    args, kwargs = pytree.tree_unflatten(leaves, call.spec)
    with RngRewind(call.rng), torch.enable_grad(), hooks.paused():
        out = call.fn(*args, **kwargs)
    out_leaves = pytree.tree_leaves(out)
    outs, out_grads = [], []
    for slot, g in zip(call.grad_slots, grads):
        o = out_leaves[slot]
        if g is not None and isinstance(o, torch.Tensor) and o.requires_grad:
            outs.append(o)
            out_grads.append(g)
    if outs:
        torch.autograd.backward(outs, out_grads)
    return tuple(t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs)


class CheckpointFunction(torch.autograd.Function):
    """Keeps the tensor inputs (through ``save_for_backward``), drops everything else."""

    @staticmethod
    def forward(ctx, call: _CheckpointedCall, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.call = call
        ctx.save_for_backward(*tensors)
        return tuple(checkpoint_forward(call, tensors))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return (None, *checkpoint_backward(ctx.call, ctx.saved_tensors, grads))


def checkpoint(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` keeping only its tensor inputs; recomputed (same RNG) in backward.

    Any argument/return structure (tuples, dicts, ``None``) is supported; returned parameters and
    tensors that do not require grad come back as they are, outside the autograd Function.
    """
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    tensors = tuple(leaves[i] for i in slots)
    call = _CheckpointedCall(fn=fn, spec=spec, leaves=[None if i in slots else x for i, x in enumerate(leaves)],
                     tensor_slots=slots, rng=RngSnapshot.capture())
    outs = CheckpointFunction.apply(call, *tensors)
    out_leaves = list(call.out_leaves)
    for slot, o in zip(call.grad_slots, outs):
        out_leaves[slot] = o
    return pytree.tree_unflatten(out_leaves, call.out_spec)


# ------------------------------------------------------------------- discard a norm's output


@dataclasses.dataclass
class _Recomputable:
    fn: Callable
    inputs: tuple
    rng: RngSnapshot
    output: Callable[[], Optional[torch.Tensor]]  # weak reference to the registered output
    value: Optional[torch.Tensor] = None


class DiscardOutputPacker:
    """Packs a registered output as a recipe (function + inputs) instead of its values.

    Used for norms: their output is saved by the next linear; the norm's input is already kept for
    the norm's own backward, so the recipe costs nothing and the output is recomputed once, when the
    consumer's backward first unpacks it.

    A saved tensor matches a registered output only while that output is alive and the two have the
    same storage, offset, shape, strides, dtype and version: the same values.  Once the output is freed
    its memory can hold another tensor of the same shape (the next activation), which must be saved as
    itself, so a freed output's entry is dropped.
    """

    def __init__(self) -> None:
        self._outputs: dict[tuple, _Recomputable] = {}

    def register(self, output: torch.Tensor, fn: Callable, inputs: tuple, rng: RngSnapshot) -> None:
        key = _identity(output)
        recipe = _Recomputable(fn, tuple(i.detach() for i in inputs), rng, weakref.ref(output))
        self._outputs[key] = recipe
        weakref.finalize(output, self._forget, key, recipe)

    def _forget(self, key: tuple, recipe: _Recomputable) -> None:
        if self._outputs.get(key) is recipe:
            del self._outputs[key]

    def pack(self, tensor: torch.Tensor) -> Optional[_Recomputable]:
        recipe = self._outputs.get(_identity(tensor))
        return recipe if recipe is not None and recipe.output() is not None else None

    def unpack(self, recipe: _Recomputable) -> torch.Tensor:
        if recipe.value is None:
            with RngRewind(recipe.rng), torch.no_grad():
                recipe.value = recipe.fn(*recipe.inputs)
        return recipe.value

    def clear(self) -> None:
        self._outputs.clear()


def _identity(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
            t._version)


def discard_output(module: torch.nn.Module, packer: DiscardOutputPacker) -> Callable[[], None]:
    """Wrap ``module.forward`` so its (single tensor) output is recomputed instead of kept."""
    original = module.forward

    @functools.wraps(original)
    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        rng = RngSnapshot.capture()
        out = original(hidden_states, *args, **kwargs)
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and not args and not kwargs:
            packer.register(out, original, (hidden_states,), rng)
        return out

    return patch(module, "forward", forward, "selective recompute: the output is recomputed, not kept").undo


def checkpoint_module(module: torch.nn.Module) -> Callable[[], None]:
    """Wrap ``module.forward`` in :func:`checkpoint`; returns the function that unwraps it."""
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(original, *args, **kwargs)

    return patch(module, "forward", forward, "recompute: the module runs checkpointed").undo


# --------------------------------------------------------------------- Megatron layer wiring

# Selective recompute: which submodule of a TransformerLayer each name means, and why recomputing it pays.
SELECTIVE_TARGETS: dict[str, tuple[str, ...]] = {
    # s^2-free with flash-style kernels, but the local attention keeps [b, np, s, s] probabilities.
    "core_attn": ("self_attention.core_attention",),
    # Cheap GEMMs whose inputs (norm outputs) are large; recomputing saves the q/k/v activations.
    "qkv": ("self_attention.linear_qkv",),
    "proj": ("self_attention.linear_proj",),
    # The ffn-sized intermediate (4h or 8/3h per token) is the biggest per-layer tensor.
    "mlp": ("mlp",),
}
# Norm outputs are dropped and recomputed when their consumer's backward needs them.
NORM_TARGETS = ("input_layernorm", "pre_mlp_layernorm")


def find_submodule(root: torch.nn.Module, dotted: str) -> Optional[torch.nn.Module]:
    module: Any = root
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _is_identity(module: torch.nn.Module) -> bool:
    return type(module).__name__ in ("IdentityOp", "IdentityFuncOp", "Identity")


def apply_selective_recompute(layer: torch.nn.Module, modules: tuple,
                              packer: DiscardOutputPacker) -> list[Callable[[], None]]:
    """Wrap the named parts of one TransformerLayer; returns the unwrap functions."""
    removers = []
    for name in modules:
        if name == "layernorm":
            for path in NORM_TARGETS:
                norm = find_submodule(layer, path)
                if norm is not None and not _is_identity(norm):
                    removers.append(discard_output(norm, packer))
            continue
        for path in SELECTIVE_TARGETS[name]:
            target = find_submodule(layer, path)
            if target is not None and not _is_identity(target):
                removers.append(checkpoint_module(target))
    return removers


def full_recompute_layers(num_layers: int, method: str, count: int) -> list[int]:
    """Indices (0-based, within this stage) of the layers full recompute wraps."""
    if method == "uniform" or count == 0:
        return list(range(num_layers))
    return list(range(min(count, num_layers)))
