"""Megatron-LM's ``megatron.training`` in a CPU-only process: the redirects ``cpu_compat`` lacks.

:func:`cpu_training` is :func:`megatron_longctx.cpu_compat.enabled` plus what Megatron-LM's training
loop (``megatron.training``) needs on a process without a GPU.  Each redirect names the Megatron code it
stands in for; nothing happens when CUDA is available, and everything is restored on exit.

* ``get_device_arch_version`` (``validate_args``) reads ``cuda:0``'s properties: arch 0 on the CPU;
* ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda``; ``_initialize_distributed`` and
  ``_set_random_seed`` skip the model-parallel groups and the tracker seeds when
  ``torch.cuda.device_count() == 0``: they see one device;
* ``compile_helpers`` runs ``make`` in the wheel, which ships the compiled helpers but no Makefile;
* ``_warmup_jit_function`` allocates on ``"cuda"``: nothing to warm up without fused kernels;
* ``device="cuda"`` factories in ``megatron.training`` and the rerun state machine, and ``.cuda()``
  on tensors: the CPU;
* ``torch.cuda.Stream`` / ``stream`` contexts (DDP wrap, checkpoint finalisation): no-ops.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

import torch

from megatron_longctx import cpu_compat

# Megatron-LM modules with hard-coded device="cuda" allocations.
_CUDA_FACTORY_MODULES = (
    "megatron.training.training",
    "megatron.training.utils",
    "megatron.training.utils.common_utils",
    "megatron.training.checkpointing",
    "megatron.training.initialize",
    "megatron.training.global_vars",
    "megatron.core.rerun_state_machine",
    "megatron.core.num_microbatches_calculator",
    "megatron.core.models.dist_utils",
)


class _NullStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, *args: Any, **kwargs: Any) -> None:
        return None


@contextlib.contextmanager
def _null_stream_ctx(*args: Any, **kwargs: Any) -> Iterator[None]:
    yield


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _patches() -> list[tuple[Any, str, Any]]:
    from megatron.core.datasets import utils as dataset_utils
    from megatron.training import arguments, initialize
    from megatron.training.utils import common_utils

    patches: list[tuple[Any, str, Any]] = [
        (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "set_device", lambda device: None),
        (torch.cuda, "Stream", _NullStream),
        (torch.cuda, "stream", _null_stream_ctx),
        (torch.Tensor, "cuda", _tensor_cuda),
        (dataset_utils, "compile_helpers", lambda *a, **k: None),
        (initialize, "_warmup_jit_function", lambda *a, **k: None),
        (initialize, "_compile_dependencies", lambda *a, **k: None),
    ]
    for owner in (common_utils, arguments):
        if hasattr(owner, "get_device_arch_version"):
            patches.append((owner, "get_device_arch_version", lambda: 0))
    original_init = initialize.initialize_megatron

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    for name in ("megatron.training.initialize", "megatron.training.training", "megatron.training"):
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            if getattr(module, "initialize_megatron", None) is original_init:
                patches.append((module, "initialize_megatron", initialize_megatron))
    cpu_torch = cpu_compat._cpu_torch()
    for name in _CUDA_FACTORY_MODULES:
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            if getattr(module, "torch", None) is torch:
                patches.append((module, "torch", cpu_torch))
    return patches


@contextlib.contextmanager
def cpu_training() -> Iterator[None]:
    """``megatron.training`` on the CPU for the ``with`` block (a plain ``cpu_compat`` block on a GPU)."""
    if not cpu_compat.needed():
        yield
        return
    import megatron.training.training  # noqa: F401  (import before patching: names are bound at import)

    saved = []
    with cpu_compat.enabled():
        try:
            for owner, name, replacement in _patches():
                saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, replacement)
            yield
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)
