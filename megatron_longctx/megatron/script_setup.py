"""What every way of running a Megatron-LM script sets up, whoever runs it: the launcher
(:mod:`megatron_longctx.megatron.launch`), the CPU runner (``python -m megatron_longctx.megatron.cpu_compat``), the
``patches/`` hooks and the main job's worker.

* :func:`skip_built_helpers`: Megatron's start-up build of the dataset helpers only when the compiled
  ``helpers_cpp`` does not import (the megatron-core wheel ships it, without the Makefile);
* :func:`log_losses`: each iteration's losses appended to ``$LONGCTX_LOSS_LOG``;
* :func:`megatron_default_args`: the defaults Megatron-LM lacks on any device;
* :func:`has_transformer_engine`: whether Transformer Engine imports.

It imports nothing of Megatron or of this package at module level.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import os
from typing import Any, Callable

# A file to which the launcher appends each iteration's losses, at full precision, as JSON lines.
LOSS_LOG_ENV = "LONGCTX_LOSS_LOG"


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA install raising OSError/RuntimeError
        return False
    return True


def wrap_compile_helpers(original: Callable) -> Callable:
    """``compile_helpers`` (``make -C megatron/core/datasets`` on rank 0 at start-up) only when the compiled
    ``helpers_cpp`` does not import: the megatron-core wheel ships it, without the Makefile."""

    @functools.wraps(original)
    def compile_helpers(*args, **kwargs):
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            return original(*args, **kwargs)
        return None

    compile_helpers.__longctx_wrapped__ = original
    return compile_helpers


def skip_built_helpers() -> None:
    """For the process's lifetime, skip Megatron's helpers build when ``helpers_cpp`` imports (idempotent;
    :func:`megatron_longctx.megatron.launch.install` does it reversibly; the ``patches/`` hooks and
    ``python -m megatron_longctx.megatron.cpu_compat`` call this)."""
    with contextlib.suppress(ImportError):
        datasets_utils = importlib.import_module("megatron.core.datasets.utils")
        if not hasattr(datasets_utils.compile_helpers, "__longctx_wrapped__"):
            datasets_utils.compile_helpers = wrap_compile_helpers(datasets_utils.compile_helpers)


def wrap_training_log(original: Callable) -> Callable:
    """``training_log`` that also appends this iteration's losses (and gradient norm, as ``"grad norm"``) at
    full precision to the JSON-lines file named by ``$LONGCTX_LOSS_LOG`` (on the last rank, the one Megatron
    logs losses on)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs):
        path = os.environ.get(LOSS_LOG_ENV)
        if path and loss_dict and _is_last_rank():
            losses = {key: float(value) for key, value in loss_dict.items()}
            bound = signature.bind_partial(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)
            if bound.arguments.get("grad_norm") is not None:
                losses["grad norm"] = float(bound.arguments["grad_norm"])
            with open(path, "a") as f:
                f.write(json.dumps({"iteration": int(iteration), **losses}) + "\n")
        return original(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)

    training_log.__longctx_wrapped__ = original
    return training_log


def log_losses() -> None:
    """For the process's lifetime, write ``$LONGCTX_LOSS_LOG`` (idempotent;
    :func:`megatron_longctx.megatron.launch.install` does it reversibly; ``python -m
    megatron_longctx.megatron.cpu_compat`` calls this)."""
    with contextlib.suppress(ImportError):
        training = importlib.import_module("megatron.training.training")
        if not hasattr(training.training_log, "__longctx_wrapped__"):
            training.training_log = wrap_training_log(training.training_log)


def _is_last_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def megatron_default_args(parser: Any) -> list[tuple[str, ...]]:
    """Defaults Megatron-LM lacks and needs on any device: ``--eval-interval 1000`` where it has none (0.19
    computes ``train_iters // eval_interval``)."""
    eval_interval = parser._option_string_actions.get("--eval-interval")
    return [("--eval-interval", "1000")] if eval_interval is not None and eval_interval.default is None else []
