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
  written back after the step (:mod:`.model_state_step`).

``install_and_report`` calls :meth:`ModelStatesFeature.defer` on the bare model the provider returns; the
install happens when Megatron builds the optimizer over the DDP-wrapped chunks.  Until then no rank holds
all of the states at once: with ``disk`` each transformer layer's weights go to their file as the layer is
built (the spec's layers do it, :func:`stashing_spec`), and DDP's gradient buffers, which the streamer replaces, are
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
from megatron_longctx.megatron.features.model_state_step import MastersOnDisk, optimizer_hooks
from megatron_longctx.memory.host_pool import HostPool
from megatron_longctx.memory.offload_disk import RunDir, default_root
from megatron_longctx.memory.model_state_shards import Shards
from megatron_longctx.memory.model_state_store import stash_weights
from megatron_longctx.memory.model_states import FLAG, ModelStateError, ModelStateStreamer, StreamOptions
from megatron_longctx.patching import patch


# Megatron-Bridge's module that builds its optimizer (with megatron-core's get_megatron_optimizer, imported
# into it): patched beside Megatron-LM's when Bridge's training loop is the one running.
BRIDGE_OPTIMIZER_MODULES = ("megatron.bridge.training.optim",)


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


class LayerStash:
    """Where the layers a spec builds put their weights (:func:`stash_weights`): one run directory under
    ``root``, made as the first layer is built (exit and signals remove it if no streamer takes its files)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.run_dir: Optional[RunDir] = None
        self.layers = 0

    def __deepcopy__(self, memo: dict) -> "LayerStash":  # a spec copied later still writes here
        return self

    def __call__(self, layer: torch.nn.Module) -> None:
        config = getattr(layer, "config", None)  # Float16Module casts every parameter after the build
        low = torch.bfloat16 if getattr(config, "bf16", False) else (
            torch.float16 if getattr(config, "fp16", False) else None)
        if self.run_dir is None:
            self.run_dir = RunDir(os.path.join(self.root, "model-states"))
        stash_weights(layer, self.run_dir, f"layer{self.layers}", low)
        self.layers += 1


@functools.lru_cache(maxsize=None)
def _stashing(layer_class: type) -> type:
    """``layer_class`` whose constructor takes ``longctx_stash`` (a :class:`LayerStash`) and hands it the
    built layer (``layer_class`` itself if it is one already)."""
    if getattr(layer_class, "_longctx_stashing", False):
        return layer_class

    def __init__(self: Any, *args: Any, longctx_stash: LayerStash, **kwargs: Any) -> None:
        layer_class.__init__(self, *args, **kwargs)
        longctx_stash(self)

    return type(layer_class.__name__, (layer_class,), {"__init__": __init__, "__module__": layer_class.__module__,
                                                       "_longctx_stashing": True})


def stashing_spec(spec: Any, stash: LayerStash) -> Any:
    """A copy of ``spec`` in which every ``TransformerLayer`` spec builds a layer that hands itself to
    ``stash`` once constructed, so that a model built from it is never whole in memory."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_longctx.megatron.spec_walk import KEEP, walk_spec

    def stashing(module_spec: Any) -> None:
        if isinstance(module_spec.module, type) and issubclass(module_spec.module, TransformerLayer):
            module_spec.module = _stashing(module_spec.module)
            module_spec.params["longctx_stash"] = stash

    return walk_spec(spec, lambda submodules, name, entry: KEEP, stashing)[0]


class ModelStatesFeature(Feature):
    name = "model states"
    waits_for_optimizer = True

    def enabled(self, cfg: LongContextConfig) -> bool:
        return cfg.model_states.enabled

    def spec(self, spec: Any, cfg: LongContextConfig) -> Any:
        """With ``disk``: every transformer layer the spec builds writes its weights to a file as it is built
        and keeps placeholders (:func:`stashing_spec`); the streamer takes the files as its units' own at
        install."""
        if cfg.model_states.model_state_offload != "disk":
            return spec
        return stashing_spec(spec, LayerStash(default_root(cfg.memory)))

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
                raise ValueError(f"{FLAG}: Megatron's distributed optimizer shards DDP's buffers, which the streamer "
                                 "replaces; build DDP and the optimizer without it and give the plugin "
                                 "ModelStateConfig(distributed_optimizer=True), which shards the off-device "
                                 "optimizer's states (the launcher and megatron-longctx run do so for "
                                 "--use-distributed-optimizer)")
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
        shards = None
        if ms.distributed_optimizer and group is not None and torch.distributed.get_world_size(group) > 1:
            streamed = {id(p) for p in params}
            outside = [n for n, p in built.chunks[0].named_parameters() if p.requires_grad and id(p) not in streamed]
            if outside:  # their gradients would be whole on every rank, counted once per rank by the norm
                raise ValueError(f"{FLAG} with --use-distributed-optimizer shards every gradient, but "
                                 f"{outside[:3]} are outside the streamed units: drop --use-distributed-optimizer")
            shards = Shards([[p.param.numel() for p in u.params] for u in streamer.units], group, streamer.idle_slots)
            streamer.shards = shards  # each unit's gradients reduce-scattered over the group
        patches: list[Callable[[], None]] = []
        if ddp is not None:
            patches.extend(_wire_ddp(ddp, streamer))
        where = ("host (pinned pool)" if pool.pin else "host") if opts.target == "host" else f"disk ({streamer.run_dir.path})"
        description = (f"weights and gradients streamed per layer through {len(streamer.wslots)} slots of "
                       f"{streamer.slot_bytes / 2**20:.2f} MiB; off-device copy in {where}")
        if shards is not None:
            description += f"; optimizer states sharded over {shards.world} data x context parallel ranks"

        def stats() -> dict[str, int]:
            return {"model_state_loads": streamer.loads, "model_state_grad_flushes": streamer.grad_flushes,
                    "model_state_peak_resident_bytes": streamer.peak_resident}

        installed = Installed(patches=patches, description=description, stats=stats, close=streamer.remove)
        installed.streamer = streamer  # type: ignore[attr-defined]
        installed.shards = shards  # type: ignore[attr-defined]
        return installed

    @contextlib.contextmanager
    def wrapping_ddp(self, model: Any, cfg: LongContextConfig) -> Iterator[None]:
        """DDP's gradient buffers for ``model`` laid out on the meta device while DDP wraps it, as the deferred
        install lays them out (:func:`_unbacked_grad_buffers`): the streamer replaces them at install."""
        patches = _unbacked_grad_buffers(model)
        try:
            yield
        finally:
            for p in patches:
                p.undo()

    def building_optimizer(self, installed: Installed) -> contextlib.AbstractContextManager:
        """With float32 masters on disk: Megatron's mixed-precision optimizer is built with its copy of each
        streamed parameter a float32 placeholder (:class:`.model_state_step.MastersOnDisk`), not the whole model
        in float32."""
        return MastersOnDisk() if installed.streamer.opts.masters else contextlib.nullcontext()

    def wire_optimizer(self, installed: Installed, optimizer: Any, cfg: LongContextConfig) -> Any:
        return optimizer_hooks(installed, installed.streamer, cfg, installed.shards)(optimizer)

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


FEATURE = ModelStatesFeature()
