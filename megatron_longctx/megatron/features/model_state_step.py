"""The ``disk`` target's optimizer step and checkpoints over streamed model states
(``--longctx-model-state-offload disk``; the installer is :mod:`.model_states`).

Megatron's optimizer wrapper stays (its gradient norm and clipping, its mixed-precision bookkeeping); its inner
AdamW becomes the off-device one (:mod:`megatron_longctx.megatron.offdevice_optimizer`), and the step brings one
unit at a time onto the host through :class:`_ClippedSource`: its gradients for Megatron's norm and for the
moments, clipped as they are read (:func:`_streamed_clipping`), then its weights, or under bf16 its float32
masters (:class:`MastersOnDisk`, :func:`_masters_streamed`), written back after the update.  Megatron's
checkpoint save and load see every unit read back from its files (:func:`_materialized`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Optional

import torch

from megatron_longctx.config import LongContextConfig
from megatron_longctx.megatron import offdevice_optimizer
from megatron_longctx.megatron.features.base import Installed
from megatron_longctx.memory.model_state_shards import Shards
from megatron_longctx.memory.model_state_store import is_placeholder, placeholder
from megatron_longctx.memory.model_states import FLAG, ModelStateStreamer
from megatron_longctx.memory.offdevice_optimizer import OffDeviceSpec
from megatron_longctx.patching import patch

BRIDGE_CHECKPOINTING = "megatron.bridge.training.checkpointing"  # Bridge's save_checkpoint / load_checkpoint


class MastersOnDisk(torch.overrides.TorchFunctionMode):
    """While Megatron's mixed-precision optimizer is built over parameters streamed from disk: its float32
    copy of a parameter (``param.detach().clone().float()``) is a float32 placeholder when the parameter is
    one; the masters' values are in the streamer's files (:meth:`OffDeviceStore.masters_in`)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func in (torch.Tensor.clone, torch.Tensor.float) and args and is_placeholder(args[0]):
            return placeholder(args[0], dtype=torch.float32 if func is torch.Tensor.float else None)
        return func(*args, **(kwargs or {}))


def optimizer_hooks(installed: Installed, streamer: ModelStateStreamer, cfg: LongContextConfig,
                    shards: Optional[Shards] = None) -> Callable[[Any], Any]:
    """For ``disk``: Adam's moments live on disk too (:mod:`megatron_longctx.megatron.offdevice_optimizer`),
    and the step brings one unit at a time onto the host: its gradients for the gradient norm and for the
    moments, then its weights for the update, written back (:func:`_streamed_clipping`); Megatron's checkpoint
    save and load see every unit's weights and gradients read back (:func:`_materialized`).  ``host``:
    nothing to add (the parameters and ``main_grad`` are views of the host copies, stepped in place).

    With ``shards`` (Megatron's distributed optimizer, :mod:`megatron_longctx.memory.model_state_shards`) the
    off-device AdamW keeps moments for this rank's range of each unit and updates only that range (``host``
    too); after each step every unit's weights are all-gathered whole, and a checkpoint save first gathers
    the moments and the float32 masters (:func:`_gathered_for_save`)."""
    if streamer.opts.target != "disk" and shards is None:
        return lambda optimizer: optimizer

    disk = streamer.opts.target == "disk"
    why = f"{FLAG} disk: the weights are read back from their files for this call"
    for module in _checkpointing_modules() if disk else ():
        for name, store in (("save_checkpoint", False), ("load_checkpoint", True)):  # a save changes no weight
            installed.patches.append(patch(module, name, _around(getattr(module, name), streamer, store),
                                           reason=why).undo)

    def wire(optimizer: Any) -> Any:
        if not disk:  # host, sharded: the off-device AdamW over Megatron's parameters, its range of each
            assert shards is not None
            spec = OffDeviceSpec(target="host", pool=streamer.opts.pool, owned=_owned(streamer, shards))
            moved = offdevice_optimizer.install(optimizer, spec)
            installed.patches.append(moved.remove)
            installed.patches.extend(_sharded_step(optimizer, moved.optimizers, streamer, shards))
            return optimizer
        wrappers = offdevice_optimizer.megatron_optimizers(optimizer)
        source = _ClippedSource(streamer)
        for wrapper in wrappers:
            kind = type(wrapper).__name__
            mixed = kind == "Float16OptimizerWithFloat16Params" and streamer.opts.masters
            if mixed and getattr(wrapper, "grad_scaler", None) is None:
                installed.patches.extend(_masters_streamed(wrapper, source))
            elif kind != "FP32Optimizer":  # the checks before start name the flags
                raise ValueError(f"{FLAG} disk steps float32 parameters, or bf16 ones with float32 masters and no "
                                 f"loss scaling; this run's optimizer is {kind}"
                                 f"{' with a loss scaler' if mixed else ''}: drop --fp16 and --loss-scale, or use "
                                 f"{FLAG} host")
        spec = OffDeviceSpec(target="disk", pool=streamer.opts.pool, disk_dir=streamer.opts.disk_dir, source=source,
                             owned=None if shards is None else _owned(streamer, shards))
        moved = offdevice_optimizer.install(optimizer, spec)
        installed.patches.append(moved.remove)
        installed.patches.extend(_streamed_clipping(wrappers, source))
        if shards is not None:
            installed.patches.extend(_sharded_step(optimizer, moved.optimizers, streamer, shards))
        return optimizer

    return wire


def _owned(streamer: ModelStateStreamer, shards: Shards) -> dict[int, tuple[int, int]]:
    """``id -> [lo, hi)``: this rank's range of each streamed parameter, under its own id and its float32
    master's (what Megatron's mixed-precision optimizer steps)."""
    owned = {}
    for u in streamer.units:
        for k, p in enumerate(u.params):
            owned[id(p.param)] = shards.owned(u.index, k)
            main = getattr(p.param, "main_param", None)
            if main is not None:
                owned[id(main)] = owned[id(p.param)]
    return owned


def _sharded_step(optimizer: Any, inner: list, streamer: ModelStateStreamer,
                  shards: Shards) -> list[Callable[[], None]]:
    """The distributed optimizer's other half.  Each rank holds the summed gradients of its range only (the
    streamer reduce-scatters them), so Megatron's gradient norm and its checks for inf and nan reduce over every
    rank, as its own distributed optimizer's do (``grad_stats_parallel_group``, the whole world: the model
    parallel ranks times the data x context parallel ones).  Before Megatron's step the gradients summed
    whole (a tied embedding's) keep only this rank's range too; after it (which updated this rank's range of
    every unit) every unit's weights are all-gathered whole off the device.  Megatron's checkpoint save first
    gathers every rank's moments and float32 masters (:func:`_gathered_for_save`)."""
    step = optimizer.step

    def sharded_step(*args: Any, **kwargs: Any) -> Any:
        streamer.keep_owned_grads()
        out = step(*args, **kwargs)
        streamer.gather_weights(shards)
        return out

    why = f"{FLAG} with the distributed optimizer"
    undo = [patch(optimizer, "step", sharded_step, reason=f"{why}: each rank's updated range gathered").undo]
    for wrapper in offdevice_optimizer.megatron_optimizers(optimizer):
        undo.append(patch(wrapper, "grad_stats_parallel_group", torch.distributed.group.WORLD, create=True,
                          reason=f"{why}: each rank's gradients are its range's; their norm sums over all").undo)
    for module in _checkpointing_modules():
        save = getattr(module, "save_checkpoint")

        def gathered_save(*args: Any, save: Any = save, **kwargs: Any) -> Any:
            with _gathered_for_save(inner, streamer, shards):
                return save(*args, **kwargs)

        undo.append(patch(module, "save_checkpoint", gathered_save,
                          reason=f"{FLAG} with the distributed optimizer: a save holds every rank's states").undo)
    return undo


@contextlib.contextmanager
def _gathered_for_save(inner: list, streamer: ModelStateStreamer, shards: Shards) -> Any:
    """For one checkpoint save (every rank calls it): each sharded AdamW's moments whole, gathered unit by unit
    from every rank's range, and the float32 masters whole (Megatron's own on the host, the files on disk)."""
    stepped = {id(p) for opt in inner for g in opt.param_groups for p in g["params"]}
    # what the optimizer steps: the float32 master where Megatron made one, else the parameter itself
    targets = [[p.param.main_param if id(getattr(p.param, "main_param", None)) in stepped else p.param
                for p in u.params] for u in streamer.units]
    for opt, whole in zip(inner, shards.whole_moments(inner, targets)):
        opt.set_gathered(whole)
    if streamer.opts.target == "host":  # Megatron's own masters
        for u in streamer.units:
            shards.gather(u.index, [getattr(p.param, "main_param", None) for p in u.params])
    else:
        streamer.gather_masters(shards)
    try:
        yield
    finally:
        for opt in inner:
            opt.set_gathered(None)


def _checkpointing_modules() -> list:
    """The modules whose ``save_checkpoint`` / ``load_checkpoint`` the training loop running calls: Megatron-LM's
    (the wheels of megatron-core before 0.19 ship no ``megatron.training``), and Megatron-Bridge's when its
    loop is the one running (its checkpoint manager calls them from its own module)."""
    modules = []
    try:
        import megatron.training.training as training

        modules.append(training)
    except ImportError:
        pass
    bridge = sys.modules.get(BRIDGE_CHECKPOINTING)
    if bridge is not None:
        modules.append(bridge)
    return modules


class _ClippedSource:
    """The streamer as the optimizer's :class:`~megatron_longctx.memory.offdevice_optimizer.ParamSource`,
    with Megatron's clipping applied to each unit's gradients as the step brings them in.  The parameters are
    those Megatron's optimizer steps: the model's own (float32), or their float32 masters (``main_param``,
    bf16 with masters on disk), whose gradient is the model parameter's main gradient in float32 as Megatron's
    ``_copy_model_grads_to_main_grads`` makes it."""

    def __init__(self, streamer: ModelStateStreamer) -> None:
        self.streamer = streamer
        self.model_ids = {id(p) for ps in streamer.param_groups() for p in ps}
        self.groups = [[getattr(p, "main_param", p) for p in ps] for ps in streamer.param_groups()]
        self.ids = {id(p) for ps in self.groups for p in ps}
        self.clip: Optional[Callable[[list], None]] = None

    def param_groups(self) -> list[list[torch.nn.Parameter]]:
        return self.groups

    @contextlib.contextmanager
    def unclipped_grads(self, index: int) -> Any:
        with self.streamer.grads_in(index) as params:
            mains = [getattr(p, "main_param", None) for p in params]
            for p, main in zip(params, mains):
                if main is not None:
                    main.grad = p.main_grad.float()
            try:
                yield [p if main is None else main for p, main in zip(params, mains)]
            finally:
                for main in mains:
                    if main is not None:
                        main.grad = None

    @contextlib.contextmanager
    def grads_in(self, index: int) -> Any:
        with self.unclipped_grads(index) as params:
            if self.clip is not None and params:
                self.clip(params)
            yield params

    def weights_in(self, index: int) -> Any:
        if self.streamer.units[index].mpath is None:
            return self.streamer.weights_in(index)
        return self._masters_in(index)

    @contextlib.contextmanager
    def _masters_in(self, index: int) -> Any:
        """The unit's masters (and its float32 weights) as the optimizer's parameters; the weights are written
        back rounded from the masters at the end (:meth:`OffDeviceStore.masters_in`)."""
        u = self.streamer.units[index]
        with self.streamer.masters_in(index) as pairs:
            out = []
            for p, (weight, master) in zip(u.params, pairs):
                target = p.param if master is None else p.param.main_param
                target.data = weight if master is None else master
                out.append(target)
            try:
                yield out
            finally:
                for p, (_, master) in zip(u.params, pairs):
                    if master is not None:
                        p.param.main_param.data = placeholder(p.param, torch.device("cpu"), torch.float32)
                self.streamer._point_off_device(u)


def _masters_streamed(wrapper: Any, source: _ClippedSource) -> list[Callable[[], None]]:
    """Megatron's mixed-precision optimizer over parameters whose masters are on disk: its copies between the
    model's parameters and their masters skip the streamed ones (the step brings their gradients in and writes
    their weights back rounded from the masters)."""
    streamed = source.model_ids

    def copy_model_grads_to_main_grads() -> None:  # Megatron's, for the parameters not streamed
        for model_group, main_group in zip(wrapper.float16_groups, wrapper.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                if id(model_param) not in streamed:
                    grad = model_param.main_grad if hasattr(model_param, "main_grad") else model_param.grad
                    main_param.grad = None if grad is None else grad.float()
                model_param.grad = None
        for model_group in wrapper.fp32_from_fp32_groups:
            for model_param in model_group:
                if id(model_param) not in streamed:
                    model_param.grad = model_param.main_grad

    def copy_main_params_to_model_params() -> None:
        for model_group, main_group in zip(wrapper.float16_groups, wrapper.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                if id(model_param) not in streamed:
                    model_param.data.copy_(main_param.data)

    why = f"{FLAG} disk: the float32 masters of streamed parameters are in files"
    return [patch(wrapper, "_copy_model_grads_to_main_grads", copy_model_grads_to_main_grads, reason=why).undo,
            patch(wrapper, "_copy_main_params_to_model_params", copy_main_params_to_model_params, reason=why).undo]


def _streamed_clipping(wrappers: list, source: _ClippedSource) -> list[Callable[[], None]]:
    """Megatron's gradient norm and clipping with one unit's gradients on the host at a time.

    Each wrapper's gradients for the norm (``get_grads_for_grad_norm``, ``get_main_grads_for_grad_norm`` on
    older megatron-core) become one one-element tensor per parameter holding that gradient's norm, read unit
    by unit: Megatron's ``get_grad_norm_fp32`` over them is the norm over the gradients (the per-tensor norms
    are where its own reduction starts).  Megatron's ``clip_grad_by_total_norm_fp32``, called by the wrapper
    or by a ``ChainedOptimizer`` with the total norm, scales the parameters that are not streamed; its
    coefficient is applied to each unit's gradients as the step reads them (:func:`_scale_as_megatron`)."""
    import megatron.core.optimizer.optimizer as megatron_optimizer

    device = source.streamer.opts.device  # where Megatron's norm runs (its multi-tensor kernels on a GPU)
    undo: list[Callable[[], None]] = []
    for wrapper in wrappers:
        name = ("get_grads_for_grad_norm" if hasattr(wrapper, "get_grads_for_grad_norm")
                else "get_main_grads_for_grad_norm")  # megatron-core 0.16
        original = getattr(wrapper, name)

        def grads_for_norm(*args: Any, wrapper: Any = wrapper, original: Any = original,
                           **kwargs: Any) -> list[torch.Tensor]:
            kept = {id(g) for g in original(*args, **kwargs)}  # parameters not streamed: their gradients
            norms: dict[int, torch.Tensor] = {}
            for i in range(len(source.param_groups())):
                with source.unclipped_grads(i) as params:
                    owner = {id(p.grad): p for p in params if p.grad is not None}
                    for g in original(*args, **kwargs):  # Megatron's filter: not shared, no TP duplicate
                        norms[id(owner[id(g)])] = torch.norm(g).reshape(1).to(device)
            out = []  # in Megatron's parameter order, so its reduction adds in the same order
            for p in wrapper.get_parameters():
                if id(p) in norms:
                    out.append(norms[id(p)])
                elif p.grad is not None and id(p.grad) in kept:
                    out.append(p.grad)
            return out

        undo.append(patch(wrapper, name, grads_for_norm, reason=f"{FLAG} disk: gradient norms unit by unit").undo)

    clip = megatron_optimizer.clip_grad_by_total_norm_fp32

    def clip_grad_by_total_norm_fp32(parameters: Any, max_norm: float, total_norm: float,
                                     use_decoupled_grad: bool = False) -> None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        rest = [p for p in params if id(p) not in source.ids]
        if rest:
            clip(rest, max_norm, total_norm, use_decoupled_grad)
        if len(rest) < len(params):  # the step applies it as it reads each unit
            source.clip = lambda ps: _scale_as_megatron(ps, max_norm, total_norm)

    undo.append(patch(megatron_optimizer, "clip_grad_by_total_norm_fp32", clip_grad_by_total_norm_fp32,
                      reason=f"{FLAG} disk: clipping applied unit by unit").undo)
    return undo


def _scale_as_megatron(params: list, max_norm: float, total_norm: Any) -> None:
    """``clip_grad_by_total_norm_fp32``'s scaling on one unit's gradients, which are on the host here (its
    multi-tensor kernels and checks want them on the GPU): the same coefficient, the same multiply."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if isinstance(coeff, torch.Tensor):
        coeff = coeff.clamp_max(1.0)
    elif coeff >= 1.0:
        return
    for p in params:
        p.grad.mul_(coeff.to(p.grad.device) if isinstance(coeff, torch.Tensor) else coeff)


def _around(fn: Callable[..., Any], streamer: ModelStateStreamer, store: bool) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with _materialized(streamer, store):
            return fn(*args, **kwargs)

    return call


@contextlib.contextmanager
def _materialized(streamer: ModelStateStreamer, store: bool) -> Any:
    """Every unit's weights and accumulated gradients as host tensors for the parameters' ``.data`` and
    ``main_grad``; afterwards (``store``: the call may have changed them, as a load does) the weights are
    written back to the files."""
    for i, u in enumerate(streamer.units):
        for p, w, g, m in zip(u.params, streamer.unit_weights(i), streamer.unit_grads(i), streamer.unit_masters(i)):
            p.param.data = w
            if g is not None:
                p.param.main_grad = g
            if m is not None:  # Megatron's float32 master, in its optimizer's state dict
                p.param.main_param.data = m
    try:
        yield
    finally:
        for i, u in enumerate(streamer.units):
            if store:
                streamer.store_weights(i, [p.param.data for p in u.params])
                if u.mpath is not None:
                    streamer.store_masters(i, [p.param.main_param.data if p.moffset >= 0 else None
                                               for p in u.params])
            for p in u.params:
                if u.mpath is not None and p.moffset >= 0:
                    p.param.main_param.data = placeholder(p.param, torch.device("cpu"), torch.float32)
            streamer._point_off_device(u)
