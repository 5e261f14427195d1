"""Model-state offload (``--longctx-model-state-offload host|disk``) on a model Megatron trains.

The installer runs last, over the model as Megatron's ``DistributedDataParallel`` left it (DDP points each
parameter at its ``param_data`` buffer and ``main_grad`` at its ``grad_data`` buffer when it is built, so
the streamer must come after it): a :class:`~megatron_longctx.memory.model_states.ModelStateStreamer` over
the units of each chunk (the embedding, every transformer layer, the final norm, the output layer; a tied
embedding and output layer are one unit that both bring in).  Each parameter's ``.data`` and ``main_grad``
then point at the off-device copy between uses, so what DDP and Megatron's optimizer read is the truth:

* DDP's gradient hook runs after the streamer's (which adds ``param.grad`` into the slot and clears it), so
  it adds nothing twice; the streamer reduces each unit's slot over DDP's data x context parallel group with
  DDP's scaling factor on the step's last micro-batch;
* ``zero_grad_buffer`` also zeroes the off-device accumulators, ``no_sync`` also holds the streamer's
  reduction, ``finish_grad_sync`` first flushes any unit whose backward missed a parameter;
* the optimizer steps the off-device copies in place (``host``); for ``disk`` each optimizer step and each
  checkpoint save see the weights and gradients read back from the files, and the updated weights are
  written back after the step.

``install_and_report`` calls :meth:`ModelStatesFeature.defer` on the bare model the provider returns; the
install happens when Megatron builds the optimizer over the DDP-wrapped chunks.  Until then no rank holds
all of the states at once: with ``disk`` each transformer layer's weights go to their file as the layer is
built (:meth:`ModelStatesFeature.building`), and DDP's gradient buffers, which the streamer replaces, are
laid out without memory behind them (:func:`_unbacked_grad_buffers`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
from typing import Any, Callable, Iterator, Optional

import torch

from megatron_longctx.config import LongContextConfig
from megatron_longctx.megatron.features.base import Built, Feature, Installed, unwrap
from megatron_longctx.memory.host_pool import HostPool
from megatron_longctx.memory.offload_disk import RunDir, default_root
from megatron_longctx.memory.model_state_store import is_placeholder, placeholder, stash_weights
from megatron_longctx.memory.model_states import FLAG, ModelStateError, ModelStateStreamer, StreamOptions
from megatron_longctx.patching import patch


# Megatron-Bridge's module that builds its optimizer (with megatron-core's get_megatron_optimizer, imported
# into it): patched beside Megatron-LM's when Bridge's training loop is the one running.
BRIDGE_OPTIMIZER_MODULES = ("megatron.bridge.training.optim",)
BRIDGE_CHECKPOINTING = "megatron.bridge.training.checkpointing"  # Bridge's save_checkpoint / load_checkpoint


def check_disk_dir(cfg: LongContextConfig) -> None:
    """The directory ``disk``'s files go under (``--longctx-offload-disk-dir``, or its default) can be written;
    ``ValueError`` naming the flag and the fix otherwise."""
    from megatron_longctx.memory.model_state_checks import check_disk_dir as check

    check(default_root(cfg.memory))


def _units(chunk: torch.nn.Module, norm_with_output: bool = False) -> list[Any]:
    """The units of one (unwrapped) GPT chunk in the order its forward uses them.  ``norm_with_output``: the
    decoder's final norm is in the output layer's unit (the tiled loss with recompute runs it inside the output
    layer's call, :func:`megatron_longctx.megatron.tiled_loss.install_tiled_loss`)."""
    units: list[Any] = []
    decoder = getattr(chunk, "decoder", None)
    if decoder is None:
        raise ValueError(f"{FLAG}: streams a GPT-like model (embedding, decoder.layers, output_layer); "
                         f"{type(chunk).__name__} has no decoder: drop the flag")
    embedding = getattr(chunk, "embedding", None) if getattr(chunk, "pre_process", False) else None
    output = getattr(chunk, "output_layer", None) if getattr(chunk, "post_process", False) else None
    tied = (embedding is not None and output is not None and getattr(output, "weight", None) is None
            and getattr(chunk, "share_embeddings_and_output_weights", False))
    final_norm = getattr(decoder, "final_layernorm", None)
    if final_norm is not None and not any(True for _ in final_norm.parameters()):
        final_norm = None
    merged = norm_with_output and output is not None and final_norm is not None
    if embedding is not None:
        units.append((embedding, output, *((final_norm,) if merged else ())) if tied else embedding)
    units.extend(decoder.layers)
    if final_norm is not None and not merged:
        units.append(final_norm)
    if output is not None and not tied and any(True for _ in output.parameters()):
        units.append((final_norm, output) if merged else output)
    if getattr(chunk, "mtp_process", False):
        raise ValueError(f"{FLAG}: multi-token prediction layers are not streamed; drop --mtp-num-layers or the flag")
    return units


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class ModelStatesFeature(Feature):
    name = "model states"
    waits_for_optimizer = True

    def enabled(self, cfg: LongContextConfig) -> bool:
        return cfg.model_states.enabled

    @contextlib.contextmanager
    def building(self, cfg: LongContextConfig) -> Iterator[None]:
        """With ``disk``: each transformer layer's weights are written to a file as Megatron's block builds the
        layer, and the layer keeps placeholders (:func:`~megatron_longctx.memory.model_state_store.stash_weights`);
        the streamer takes the files as its units' own at install."""
        if cfg.model_states.model_state_offload != "disk":
            yield
            return
        import megatron.core.transformer.transformer_block as block
        from megatron.core.transformer.transformer_layer import TransformerLayer

        run_dir = RunDir(os.path.join(default_root(cfg.memory), "model-states"))
        stashed = 0

        def build_module(original: Callable[..., Any], spec: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal stashed
            module = original(spec, *args, **kwargs)
            if isinstance(module, TransformerLayer):
                config = getattr(module, "config", None)  # Float16Module casts every parameter after the build
                low = torch.bfloat16 if getattr(config, "bf16", False) else (
                    torch.float16 if getattr(config, "fp16", False) else None)
                stash_weights(module, run_dir, f"layer{stashed}", low)
                stashed += 1
            return module

        with patch(block, "build_module", functools.partial(build_module, block.build_module),
                   reason=f"{FLAG} disk: each layer's weights to its file as the layer is built"):
            try:
                yield
            except BaseException:
                run_dir.remove()
                raise
        if not stashed:
            run_dir.remove()

    def install(self, built: Built, cfg: LongContextConfig) -> Installed:
        ms, mem = cfg.model_states, cfg.memory
        if getattr(built.config, "gradient_accumulation_fusion", False):
            raise ValueError(f"{FLAG}: Megatron's fused weight-gradient accumulation adds into the main_grad its "
                             "forward saw (the off-device copy), not the device slot a layer's backward streams "
                             "through; add --no-gradient-accumulation-fusion (Bridge: "
                             "model.gradient_accumulation_fusion=false)")
        wrappers = list(built.model) if isinstance(built.model, (list, tuple)) else [built.model]
        if len(built.chunks) != 1:
            raise ValueError(f"{FLAG}: one model chunk per rank is streamed; drop "
                             "--num-layers-per-virtual-pipeline-stage or the flag")
        ddp = wrappers[0] if hasattr(wrappers[0], "zero_grad_buffer") else None
        units = _units(built.chunks[0], norm_with_output=mem.tiled_loss_tiles > 1 and mem.tiled_loss_recompute)
        params = [p for u in units for m in (u if isinstance(u, tuple) else (u,)) for p in m.parameters()]
        grad_dtype, group, scale = torch.float32, None, 1.0
        if ddp is not None:
            if getattr(ddp.ddp_config, "use_distributed_optimizer", False):
                raise ValueError(f"{FLAG}: the distributed optimizer shards DDP's buffers the streamer replaces; "
                                 "drop --use-distributed-optimizer")
            if getattr(ddp.ddp_config, "overlap_grad_reduce", False) or getattr(ddp.ddp_config, "average_in_collective", False):
                raise ValueError(f"{FLAG}: the streamer reduces each unit's gradients itself; drop "
                                 "--overlap-grad-reduce and --ddp-average-in-collective")
            main = next((p.main_grad for p in params if getattr(p, "main_grad", None) is not None), None)
            grad_dtype = main.dtype if main is not None else torch.float32
            group = ddp.dp_cp_group
            buckets = [b for g in ddp.bucket_groups for b in g.buckets]
            factors = {b.gradient_scaling_factor for b in buckets}
            if len(factors) > 1:
                raise ValueError(f"{FLAG}: DDP's buckets scale gradients by {sorted(factors)}; one factor is needed")
            scale = factors.pop() if factors else 1.0
        pool = HostPool(mem.offload_host_pool_bytes)
        disk_dir = default_root(mem) if ms.model_state_offload == "disk" else None
        # a tied embedding's copies on the first and last pipeline stage: Megatron sums their gradients on
        # main_grad after backward, so those stay in host memory with disk
        shared = tuple(i for i, u in enumerate(units) for m in (u if isinstance(u, tuple) else (u,))
                       if any(getattr(p, "shared_embedding", False) for p in m.parameters()))
        # disk under bf16: Megatron's float32 master copies go to files beside the weights
        masters = disk_dir is not None and any(p.dtype in (torch.bfloat16, torch.float16) for p in params)
        opts = StreamOptions(target=ms.model_state_offload, device=_device(), pool=pool,
                             disk_dir=disk_dir,
                             slots=ms.model_state_slots, grad_dtype=grad_dtype, accumulate_grad=True,
                             reduce_group=group, grad_scale=scale, host_grad_units=shared, masters=masters)
        streamer = ModelStateStreamer(units, opts)
        patches: list[Callable[[], None]] = []
        if ddp is not None:
            patches.extend(_wire_ddp(ddp, streamer))
        where = ("host (pinned pool)" if pool.pin else "host") if opts.target == "host" else f"disk ({streamer.run_dir.path})"
        description = (f"weights and gradients streamed per layer through {len(streamer.wslots)} slots of "
                       f"{streamer.slot_bytes / 2**20:.2f} MiB; off-device copy in {where}")

        def stats() -> dict[str, int]:
            return {"model_state_loads": streamer.loads, "model_state_grad_flushes": streamer.grad_flushes,
                    "model_state_peak_resident_bytes": streamer.peak_resident}

        installed = Installed(patches=patches, description=description, stats=stats, close=streamer.remove)
        installed.streamer = streamer  # type: ignore[attr-defined]
        return installed

    def building_optimizer(self, installed: Installed) -> contextlib.AbstractContextManager:
        """With float32 masters on disk: Megatron's mixed-precision optimizer is built with its copy of each
        streamed parameter a float32 placeholder (:class:`_MastersOnDisk`), not the whole model in float32."""
        return _MastersOnDisk() if installed.streamer.opts.masters else contextlib.nullcontext()

    def wire_optimizer(self, installed: Installed, optimizer: Any, cfg: LongContextConfig) -> Any:
        return _optimizer_hooks(installed, installed.streamer, cfg)(optimizer)

    def defer(self, model: Any, cfg: LongContextConfig, who: str, line: Optional[str]) -> None:
        """Install when the training loop builds the optimizer over the DDP-wrapped ``model`` (the next
        ``get_megatron_optimizer`` call of Megatron-LM's loop, or of Megatron-Bridge's when it is running);
        then rank 0 prints the "memory features:" line (``line``: what the other features installed) with the
        model states in it."""
        import megatron.training.training as training

        builders = [training] + [sys.modules[name] for name in BRIDGE_OPTIMIZER_MODULES if name in sys.modules]
        patches: list = _unbacked_grad_buffers(model)

        def build(original: Callable[..., Any], config: Any, model_chunks: Any, *args: Any, **kwargs: Any) -> Any:
            for p in patches:
                p.undo()
            if unwrap(model_chunks)[0] is not unwrap(model)[0]:
                raise RuntimeError(f"{FLAG}: the optimizer is built over another model than the one installed")
            built = Built.of(model_chunks)
            installed = self.install(built, cfg)
            for chunk in built.chunks:
                chunk._longctx_model_states = installed
            atexit.register(_close, installed)
            if os.environ.get("RANK", "0") == "0":
                parts = [p for p in (line, f"{self.name}: {installed.description}") if p]
                print(f"{who}: memory features: {'; '.join(parts)}", flush=True)
            with self.building_optimizer(installed):
                optimizer = original(config, model_chunks, *args, **kwargs)
            return self.wire_optimizer(installed, optimizer, cfg)

        for module in builders:
            patches.append(patch(module, "get_megatron_optimizer",
                                 functools.partial(build, module.get_megatron_optimizer),
                                 reason=f"{FLAG}: install the streamer once DDP has wrapped the model"))
        self.pending = patches


class _MastersOnDisk(torch.overrides.TorchFunctionMode):
    """While Megatron's mixed-precision optimizer is built over parameters streamed from disk: its float32
    copy of a parameter (``param.detach().clone().float()``) is a float32 placeholder when the parameter is
    one; the masters' values are in the streamer's files (:meth:`OffDeviceStore.masters_in`)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func in (torch.Tensor.clone, torch.Tensor.float) and args and is_placeholder(args[0]):
            return placeholder(args[0], dtype=torch.float32 if func is torch.Tensor.float else None)
        return func(*args, **(kwargs or {}))


class _ZerosOnMeta(torch.overrides.TorchFunctionMode):
    """``torch.zeros`` on the meta device: a tensor with shape and dtype but no memory."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.zeros:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _unbacked_grad_buffers(model: Any) -> list:
    """Until the streamer is installed: DDP's gradient buffers for ``model``'s parameters (a main gradient
    for every weight, which the streamer replaces with its off-device accumulators and frees) are laid out
    on the meta device, so they never hold memory.  Not for a model with expert-parallel parameters (DDP
    keeps and reduces those buffers itself) or the distributed optimizer (refused at install)."""
    chunks = unwrap(model)
    params = [p for chunk in chunks for p in chunk.parameters()]
    if any(not getattr(p, "allreduce", True) for p in params):
        return []
    import megatron.core.distributed.param_and_grad_buffer as buffers

    mine = {id(p) for p in params}
    original = buffers._ParamAndGradBuffer.__init__

    def init(buffer: Any, *args: Any, **kwargs: Any) -> None:
        ddp_config = args[0] if args else kwargs["ddp_config"]
        given = args[3] if len(args) > 3 else kwargs.get("params_with_names", kwargs.get("params", ()))
        ours = all(id(p[0] if isinstance(p, tuple) else p) in mine for p in given)
        if not ours or getattr(ddp_config, "use_distributed_optimizer", False):
            return original(buffer, *args, **kwargs)
        with _ZerosOnMeta():
            return original(buffer, *args, **kwargs)

    return [patch(buffers._ParamAndGradBuffer, "__init__", init,
                  reason=f"{FLAG}: DDP's gradient buffers hold no memory until the streamer replaces them")]


def _close(installed: Installed) -> None:
    for undo in reversed(installed.patches):
        undo()
    installed.patches.clear()
    if installed.close is not None:
        installed.close()
        installed.close = None


def _wire_ddp(ddp: Any, streamer: ModelStateStreamer) -> list[Callable[[], None]]:
    zero, finish, no_sync, scale = ddp.zero_grad_buffer, ddp.finish_grad_sync, ddp.no_sync, ddp.scale_gradients
    streamed = {id(p.param) for u in streamer.units for p in u.params}
    # every parameter DDP holds is streamed: its param_data / grad_data buffers are no one's any more (the
    # parameters and main_grad point at the off-device copies), so they are freed and DDP's own zeroing,
    # reduction and scaling of them are skipped
    free = all(id(p) in streamed for p in ddp.param_to_bucket_group) and not ddp.expert_parallel_buffers
    if not free and any(b.grad_data is not None and b.grad_data.is_meta for b in ddp.buffers):
        raise ModelStateError(f"{FLAG}: DDP's gradient buffers were laid out for the streamer, but it streams "
                              "only some of DDP's parameters; drop the flag")
    if free:
        for buf in ddp.buffers:
            for bucket in buf.buckets:
                bucket.param_data = bucket.grad_data = None
            buf.param_data = buf.grad_data = None

    def zero_grad_buffer(*args: Any, **kwargs: Any) -> Any:
        streamer.zero_grad()
        if not free:
            return zero(*args, **kwargs)
        for param in ddp.params_with_grad:
            param.grad_added_to_main_grad = False
        for group in ddp.bucket_groups:
            group.reset()
        return None

    def finish_grad_sync(*args: Any, **kwargs: Any) -> Any:
        streamer.finish_backward()
        return None if free else finish(*args, **kwargs)

    def scale_gradients(factor: float) -> Any:  # Megatron's per-token loss: the accumulators are the gradients
        streamer.scale_grads(factor)
        return None if free else scale(factor)

    @contextlib.contextmanager
    def held_sync() -> Any:
        streamer.sync_grads = False
        try:
            with no_sync():
                yield
        finally:
            streamer.sync_grads = True

    why = f"{FLAG}: DDP's gradient buffers are the streamer's off-device copies"
    return [patch(ddp, "zero_grad_buffer", zero_grad_buffer, reason=why).undo,
            patch(ddp, "finish_grad_sync", finish_grad_sync, reason=why).undo,
            patch(ddp, "scale_gradients", scale_gradients, reason=why).undo,
            patch(ddp, "no_sync", held_sync, reason=why).undo]


def _optimizer_hooks(installed: Installed, streamer: ModelStateStreamer, cfg: LongContextConfig) -> Callable[[Any], Any]:
    """For ``disk``: Adam's moments live on disk too (:mod:`megatron_longctx.megatron.offdevice_optimizer`),
    and the step brings one unit at a time onto the host: its gradients for the gradient norm and for the
    moments, then its weights for the update, written back (:func:`_streamed_clipping`); Megatron's checkpoint
    save and load see every unit's weights and gradients read back (:func:`_materialized`).  ``host``:
    nothing to add (the parameters and ``main_grad`` are views of the host copies, stepped in place)."""
    if streamer.opts.target != "disk":
        return lambda optimizer: optimizer
    from megatron_longctx.megatron import offdevice_optimizer
    from megatron_longctx.memory.offdevice_optimizer import OffDeviceSpec

    why = f"{FLAG} disk: the weights are read back from their files for this call"
    for module in _checkpointing_modules():
        for name, store in (("save_checkpoint", False), ("load_checkpoint", True)):  # a save changes no weight
            installed.patches.append(patch(module, name, _around(getattr(module, name), streamer, store),
                                           reason=why).undo)

    def wire(optimizer: Any) -> Any:
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
        spec = OffDeviceSpec(target="disk", pool=streamer.opts.pool, disk_dir=streamer.opts.disk_dir, source=source)
        moved = offdevice_optimizer.install(optimizer, spec)
        installed.patches.append(moved.remove)
        installed.patches.extend(_streamed_clipping(wrappers, source))
        return optimizer

    return wire


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

    device = _device()  # where Megatron's norm runs (its multi-tensor kernels on a GPU)
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


FEATURE = ModelStatesFeature()
