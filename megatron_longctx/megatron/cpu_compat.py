"""The one place that lets Megatron-Core, and the training loops of Megatron-LM and Megatron-Bridge, run in a
CPU-only process.

:func:`enabled` (or :func:`enable` / :func:`disable`; nested calls count) redirects the CUDA calls a CPU run
reaches to the CPU for the duration of a ``with`` block; :func:`_patches`, :func:`_training_patches` and
:func:`_bridge_patches` list each redirect with its reason, and every one goes through
:func:`megatron_longctx.patching.patch`.  Nothing happens on import or when CUDA is available, and everything
is restored on exit.  Megatron modules imported *after* :func:`enable` are not patched: import Megatron first.
:func:`cpu_default_args` gives the command-line defaults a CPU process needs for Megatron-LM's scripts (flags
the user gave win); :func:`main` runs a script with them, without the plugin.
What is redirected, and the defaults: docs/launcher.md ("Without a GPU").
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys
import threading
import types
from typing import Any, Callable, Iterator

import torch

from megatron_longctx.kernels.cuda_presence import require_usable_cuda
from megatron_longctx.megatron.script_setup import (
    has_transformer_engine,
    log_losses,
    megatron_default_args,
    skip_built_helpers,
)
from megatron_longctx.patching import Patch, patch

_lock = threading.Lock()
_depth = 0
_saved: list[Patch] = []


def _cpu_get_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _no_device_to_synchronize(*args: Any, **kwargs: Any) -> None:
    return None


class _NoStream:
    """Stands for ``torch.cuda.current_stream()``: on the CPU work is ordered already, so waits are no-ops
    (DDP's grad sync waits on its events and streams)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # also stands for ``torch.cuda.Stream(...)``

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


def _current_stream(*args: Any, **kwargs: Any) -> _NoStream:
    return _NoStream()


def _current_device() -> torch.device:
    return torch.device("cpu")


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """Megatron's zigzag slice of RoPE (chunks r and 2·cp−1−r) without pinning or ``.cuda()``."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    # [..., s, ...] -> [..., 2·cp, s/(2·cp), ...] -> keep 2 chunks -> [..., s/cp, ...]
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


@functools.lru_cache
def _default_causal_mask(sq: int) -> torch.Tensor:
    """``[sq, sq]`` bool, True above the diagonal (masked), as Megatron's, on the CPU."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _on_cpu(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    return wrapper


def _cpu_torch() -> types.ModuleType:
    """A stand-in for the ``torch`` module whose tensor factories place CUDA requests on the CPU."""
    proxy = types.ModuleType("torch")
    proxy.__dict__.update(torch.__dict__)
    for name in ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn", "randint"):
        setattr(proxy, name, _on_cpu(getattr(torch, name)))
    return proxy


# Megatron modules that allocate with a hard-coded device="cuda" (not reached through current_device).
_HARD_CODED_CUDA_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens counters
    "megatron.core.distributed.param_and_grad_buffer",  # grad-buffer warm-up tensor
    "megatron.core.optimizer.optimizer",  # found_inf / loss-scale / overflow flags
    "megatron.core.optimizer.clip_grads",  # grad-norm and zero-count accumulators
    "megatron.core.utils",  # small flags and buffers of the helpers above
    "megatron.core.transformer.utils",  # get_sliding_window_causal_mask (Megatron's attention, --window-size)
)
# The same in Megatron-LM's training stack.
_HARD_CODED_CUDA_TRAINING_MODULES = (
    "megatron.training.training",  # start-time and loss-accumulator tensors
    "megatron.core.rerun_state_machine",  # validated-result flags
    "megatron.training.checkpointing",  # the loaded iteration, agreed across ranks
)


def _replace_everywhere(original: Any, replacement: Any) -> list[tuple[Any, str, Any]]:
    """Every loaded Megatron module attribute that *is* ``original`` (imported by name), to replace."""
    found = []
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("megatron.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                found.append((module, attr, replacement))
    return found


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.cuda()`` without a GPU: the tensor stays where it is (``Module.cuda`` calls this too)."""
    return self


class _CudaOneDevice(types.ModuleType):
    """``torch.cuda`` as ``megatron.training.initialize`` sees it: one device, which ``set_device`` selects."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.device_count = lambda: 1
        self.set_device = _no_device_to_synchronize

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)  # everything else: the (patched) torch.cuda


_ORIGINAL_TYPE = torch.Tensor.type


def _one_device_torch(cpu_torch: types.ModuleType) -> types.ModuleType:
    """``cpu_torch`` whose ``torch.cuda`` has one device (the training stacks' ``initialize`` modules)."""
    one_device_torch = types.ModuleType("torch")
    one_device_torch.__dict__.update(cpu_torch.__dict__)
    one_device_torch.cuda = _CudaOneDevice()
    return one_device_torch


def _type_as_on_cuda(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    """``Tensor.type()`` naming a CPU tensor's type as its CUDA twin's (``torch.cuda.BFloat16Tensor``):
    Megatron's optimizers and grad clipping check parameters and grads by those names; with an argument
    (a conversion) it is ``Tensor.type`` itself."""
    if dtype is not None or kwargs or non_blocking:
        return _ORIGINAL_TYPE(self, dtype, non_blocking, **kwargs)
    name = _ORIGINAL_TYPE(self)
    if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
        return "torch.cuda." + name[len("torch."):]
    return name


def _no_device_arch() -> int:
    """``get_device_arch_version()`` without a driver: no compute capability (0)."""
    return 0


def _allow_no_cuda(initialize_megatron: Callable) -> Callable:
    @functools.wraps(initialize_megatron)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return initialize_megatron(*args, **kwargs)

    return wrapper


def _no_jit_warmup(*args: Any, **kwargs: Any) -> None:
    return None  # the warm-up runs the fused kernels on "cuda"; the CPU defaults turn the fusions off


def _training_patches(cpu_torch: types.ModuleType) -> list[tuple[Any, str, Any]]:
    """What Megatron-LM's training stack (``megatron.training``, what ``pretrain_gpt.py`` runs) needs on a CPU
    process:

    * ``validate_args`` reads ``get_device_arch_version()`` (the driver's compute capability): 0 here;
    * ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda=True``: it is called with it;
    * ``initialize`` sets up the model-parallel groups and the RNG tracker only when
      ``torch.cuda.device_count() > 0``: that module sees one device (and ``set_device`` is a no-op);
    * ``initialize._warmup_jit_function`` warms the fused kernels on ``"cuda"``: skipped;
    * ``.cuda()`` on tensors and modules (the script's ``get_batch``, ``get_model``) returns them as they
      are, and ``megatron.training.training`` / ``checkpointing`` / ``rerun_state_machine`` allocate with
      ``device="cuda"`` (:data:`_HARD_CODED_CUDA_TRAINING_MODULES`);
    * ``torch.cuda.Stream()`` (the DDP wrap's initialisation stream) is a stream that never waits.
    """
    try:
        from megatron.training import arguments, initialize  # noqa: F401
        from megatron.training import training as _training  # noqa: F401 - imports the modules patched below
    except ImportError:  # megatron-core without megatron.training (0.16 wheel): nothing to do
        return []
    patches: list[tuple[Any, str, Any]] = [
        (torch.Tensor, "cuda", _tensor_cuda),
        (torch.cuda, "Stream", _NoStream),
        (initialize, "_warmup_jit_function", _no_jit_warmup),
    ]
    patches += _replace_everywhere(initialize.initialize_megatron, _allow_no_cuda(initialize.initialize_megatron))
    arch_checks = set()  # 0.16: megatron.core.utils; 0.19: megatron.training.utils.common_utils
    for name in ("megatron.core.utils", "megatron.training.utils.common_utils"):
        with contextlib.suppress(ImportError):
            arch_checks.add(getattr(importlib.import_module(name), "get_device_arch_version", None))
    for arch in arch_checks - {None}:
        patches += _replace_everywhere(arch, _no_device_arch)
    patches.append((initialize, "torch", _one_device_torch(cpu_torch)))
    for name in _HARD_CODED_CUDA_TRAINING_MODULES:
        with contextlib.suppress(ImportError):
            patches.append((importlib.import_module(name), "torch", cpu_torch))
    return patches


# Megatron-Bridge's training loop (``megatron.bridge.training``): modules that allocate with device="cuda".
_HARD_CODED_CUDA_BRIDGE_MODULES = (
    "megatron.bridge.training.setup",  # the start-time tensor
    "megatron.bridge.data.loaders",  # the do-train/valid/test flags
    "megatron.bridge.training.train",  # the loss-accumulator tensors
    "megatron.bridge.training.eval",  # the evaluation loss accumulators
    "megatron.bridge.training.utils.train_utils",  # loss, grad-norm and timing reductions
)


def _bridge_patches(cpu_torch: types.ModuleType) -> list[tuple[Any, str, Any]]:
    """What Megatron-Bridge's ``pretrain()`` needs on a CPU process, when Bridge's training modules are
    already imported (importing them is Bridge's job, and slow): ``initialize_megatron`` asserts CUDA unless
    ``allow_no_cuda=True``; it seeds the model-parallel RNG tracker only when ``torch.cuda.device_count() > 0``
    (one device here); it builds the dataset helpers (``compile_helpers``: the wheel ships them built, without
    the Makefile) and warms the fused kernels on ``"cuda"``; the modules above allocate with ``device="cuda"``."""
    initialize = sys.modules.get("megatron.bridge.training.initialize")
    if initialize is None:
        return []
    from megatron_longctx.megatron.script_setup import wrap_compile_helpers

    patches: list[tuple[Any, str, Any]] = [
        (initialize, "torch", _one_device_torch(cpu_torch)),
        (initialize, "_warmup_jit_function", _no_jit_warmup),
        (initialize, "compile_helpers", wrap_compile_helpers(initialize.compile_helpers)),
        (torch.Tensor, "cuda", _tensor_cuda),
        (torch.cuda, "Stream", _NoStream),
    ]
    patches += _replace_everywhere(initialize.initialize_megatron, _allow_no_cuda(initialize.initialize_megatron))
    for name in _HARD_CODED_CUDA_BRIDGE_MODULES:
        with contextlib.suppress(ImportError):
            patches.append((importlib.import_module(name), "torch", cpu_torch))
    return patches


def _patches() -> list[tuple[Any, str, Any]]:
    """Every redirect: Megatron-Core's, then the training stacks' (:func:`_training_patches`,
    :func:`_bridge_patches`).  What a CPU run of a GPTModel (local spec, gloo) meets in Megatron-Core:

    * ``torch.cuda.current_device()`` used as a device: RoPE's ``inv_freq``/``get_emb``, DDP grad buffers,
      the global memory buffer;
    * the CUDA RNG state: ``model_parallel_cuda_manual_seed``, the ``CudaRNGStatesTracker`` (``fork()``)
      and recompute's ``CheckpointFunction`` save and restore it;
    * ``get_pos_emb_on_this_cp_rank`` (RoPE under CP > 1) pins memory and calls ``.cuda()``;
    * ``torch.cuda.synchronize()`` after batched pipeline sends (``batch_p2p_sync``) and
      ``torch.cuda.current_stream()`` waits in DDP's grad sync: nothing to wait for on the CPU;
    * ``get_default_causal_mask``, ``get_sliding_window_causal_mask``, the token counters of
      ``pipeline_parallel/schedules.py`` and the optimizer's flags and grad-norm buffers allocate with
      ``device="cuda"`` (:data:`_HARD_CODED_CUDA_MODULES`);
    * the optimizers (mixed-precision and distributed) and ``clip_grad_by_total_norm_fp32`` check parameters
      and grads by their type names (``torch.cuda.FloatTensor``, ``torch.cuda.BFloat16Tensor``):
      ``Tensor.type()`` names CPU tensors so.
    """
    import torch.cuda.random

    patches: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", _current_device),
        (torch.cuda, "get_rng_state", _cpu_get_rng_state),
        (torch.cuda, "set_rng_state", _cpu_set_rng_state),
        (torch.cuda.random, "get_rng_state", _cpu_get_rng_state),
        (torch.cuda.random, "set_rng_state", _cpu_set_rng_state),
        (torch.cuda, "manual_seed", _cpu_manual_seed),
        (torch.cuda, "manual_seed_all", _cpu_manual_seed),
        (torch.cuda, "synchronize", _no_device_to_synchronize),
        (torch.cuda, "current_stream", _current_stream),
        (torch.Tensor, "type", _type_as_on_cuda),
    ]
    with contextlib.suppress(ImportError):  # first: it imports Megatron-Core modules that the lines below patch
        importlib.import_module("megatron.training.training")
    try:
        from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding  # noqa: F401
        from megatron.core.tensor_parallel import random as mp_random
        from megatron.core.transformer import utils as transformer_utils
    except ImportError:  # Megatron-Core not installed: torch-level redirects only
        return patches
    patches += [
        (mp_random, "_get_cuda_rng_state", _cpu_get_rng_state),
        (mp_random, "_set_cuda_rng_state", _cpu_set_rng_state),
    ]
    patches += _replace_everywhere(rope_utils.get_pos_emb_on_this_cp_rank, _pos_emb_on_this_cp_rank)
    patches += _replace_everywhere(transformer_utils.get_default_causal_mask, _default_causal_mask)
    cpu_torch = _cpu_torch()
    for name in _HARD_CODED_CUDA_MODULES:
        with contextlib.suppress(ImportError):
            patches.append((importlib.import_module(name), "torch", cpu_torch))
    return patches + _training_patches(cpu_torch) + _bridge_patches(cpu_torch)


class _SameGeneratorFilter(logging.Filter):
    """Drops the tracker's "CPU RNG state changed within GPU RNG context" warning: with no GPU the
    tracked state *is* the CPU generator's, so the change it reports is the intended one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_RNG_LOGGER = "megatron.core.tensor_parallel.random"
_filter = _SameGeneratorFilter()


def needed() -> bool:
    """True when this process has no usable CUDA device (the only case :func:`enabled` acts in)."""
    return not torch.cuda.is_available()


def _acts() -> bool:
    """Whether :func:`enable` / :func:`disable` act in this process; GPUs in sight but unusable are an error
    rather than a run on the CPU."""
    if not needed():
        return False
    require_usable_cuda()
    return True


def enable() -> None:
    """Start redirecting (nested calls count); a no-op when CUDA is available.  Pair with :func:`disable`.

    While it holds, the current device is ``cpu``; the CUDA RNG functions act on the CPU generator (the one
    dropout on CPU tensors draws from, so tracker forks and recompute replays stay exact);
    ``get_pos_emb_on_this_cp_rank`` and ``get_default_causal_mask`` are replaced by device-agnostic twins
    wherever Megatron imported them; the modules that hard-code ``"cuda"`` see a ``torch`` whose factories
    place on the CPU.  It imports the Megatron modules it patches; those imported after it are not patched.
    """
    global _depth
    if not _acts():
        return
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        for owner, name, replacement in _patches():
            _saved.append(patch(owner, name, replacement, "cpu_compat: Megatron on a CPU process", create=True))
        logging.getLogger(_RNG_LOGGER).addFilter(_filter)


def disable() -> None:
    """Undo :func:`enable` once every nested :func:`enable` has been undone."""
    global _depth
    if not _acts():
        return
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth > 0:
            return
        logging.getLogger(_RNG_LOGGER).removeFilter(_filter)
        while _saved:
            _saved.pop().undo()


# Megatron-LM flags a CPU process needs, each (flag tokens, why).  The flag's destination is read off
# Megatron's parser, so a user's explicit value for the same destination (either spelling) wins.
CPU_DEFAULT_ARGS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("--distributed-backend", "gloo"), "NCCL needs GPUs"),
    (("--no-persist-layer-norm",), "Apex's persistent LayerNorm kernel is CUDA-only"),
    (("--no-gradient-accumulation-fusion",), "the fused wgrad accumulation is a CUDA kernel"),
    (("--no-masked-softmax-fusion",), "the fused softmax kernels are CUDA-only"),
    (("--no-bias-gelu-fusion",), "the fused bias+GeLU is compiled for CUDA"),
    (("--no-bias-swiglu-fusion",), "the fused bias+SwiGLU is compiled for CUDA"),
    (("--no-bias-dropout-fusion",), "the fused bias+dropout+add is compiled for CUDA"),
    (("--no-rope-fusion",), "the fused RoPE kernel is Transformer Engine's (CUDA)"),
)
TRANSFORMER_IMPL_LOCAL = ("--transformer-impl", "local")
MAX_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"


def cpu_default_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(argv + the CPU defaults the user did not give, the defaults added)`` for a Megatron-LM script.

    ``argv``: the script's arguments (without the script).  Defaults: :data:`CPU_DEFAULT_ARGS`, plus
    ``--transformer-impl local`` when Transformer Engine is not importable.  A default is skipped when
    ``argv`` sets the same destination already (e.g. ``--distributed-backend nccl``).  Needs
    ``megatron.training``; returns ``argv`` unchanged when CUDA is available.
    """
    from megatron_longctx.megatron.arguments import with_defaults

    if not needed():
        return list(argv), []
    defaults = [tokens for tokens, _ in CPU_DEFAULT_ARGS]
    if not has_transformer_engine():
        defaults.append(TRANSFORMER_IMPL_LOCAL)
    argv, added = with_defaults(argv, defaults)
    if MAX_CONNECTIONS_ENV not in os.environ:  # validate_args asks for it with TP/CP > 1 below arch 10
        os.environ[MAX_CONNECTIONS_ENV] = "1"
        added.append(f"{MAX_CONNECTIONS_ENV}=1")
    return argv, added


def is_enabled() -> bool:
    return _depth > 0


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """``with cpu_compat.enabled(): ...`` runs Megatron-Core on the CPU when there is no GPU."""
    enable()
    try:
        yield
    finally:
        disable()


def main(argv: list[str] | None = None) -> None:
    """``python -m megatron_longctx.megatron.cpu_compat <script.py> [args...]``: run a Megatron-LM script on a CPU
    process with the CPU defaults, *without* installing the plugin (baseline Megatron, or a script patched
    with ``patches/``).  ``python -m megatron_longctx.launch`` is the same with the plugin installed."""
    import runpy

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m megatron_longctx.megatron.cpu_compat <script.py> [Megatron-LM args]")
        raise SystemExit(0 if argv else 2)
    if not os.path.isfile(argv[0]):
        raise SystemExit(f"megatron_longctx.megatron.cpu_compat: no such script: {argv[0]}")
    script = os.path.abspath(argv[0])
    sys.path.insert(0, os.path.dirname(script))  # before Megatron is imported: the script's tree first
    from megatron_longctx.megatron.arguments import megatron_parser, with_defaults

    skip_built_helpers()  # the wheel ships the compiled dataset helpers without their Makefile
    log_losses()  # $LONGCTX_LOSS_LOG, as the launcher writes it
    args, added = cpu_default_args(argv[1:])
    parser = megatron_parser()
    args, more = with_defaults(args, megatron_default_args(parser), parser)
    added += more
    if added and os.environ.get("RANK", "0") == "0":
        print(f"megatron_longctx.megatron.cpu_compat: defaults set (explicit flags win): {', '.join(added)}", flush=True)
    enable()
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    from megatron_longctx.megatron.cpu_compat import main as _main  # the imported module's state, not __main__'s

    _main()
