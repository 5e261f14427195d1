"""The one place that lets Megatron-Core run in a CPU-only process.

Megatron-Core assumes a GPU in a few places that a CPU run of a GPTModel (local spec, gloo) reaches.
Each is listed in :data:`_PATCHES` / :func:`_patches` with the reason:

* ``torch.cuda.current_device()`` used as a device: RoPE's ``inv_freq``/``get_emb``, DDP grad buffers,
  the global memory buffer;
* the CUDA RNG state: ``model_parallel_cuda_manual_seed``, the ``CudaRNGStatesTracker`` (``fork()``)
  and recompute's ``CheckpointFunction`` save and restore it;
* ``get_pos_emb_on_this_cp_rank`` (RoPE under CP > 1) pins memory and calls ``.cuda()``;
* ``torch.cuda.synchronize()`` after batched pipeline sends (``batch_p2p_sync``) and
  ``torch.cuda.current_stream()`` waits in DDP's grad sync: nothing to wait for on the CPU;
* ``get_default_causal_mask``, the token counters of ``pipeline_parallel/schedules.py`` and the
  optimizer's flags and grad-norm buffers allocate with ``device="cuda"``.

:func:`enabled` redirects exactly these to the CPU for the duration of a ``with`` block: the current
device is ``cpu``; the CUDA RNG functions act on the CPU generator (the one dropout on CPU tensors
draws from, so tracker forks and recompute replays stay exact); the two functions are replaced by
device-agnostic twins wherever Megatron imported them; the modules that hard-code ``"cuda"`` see a
``torch`` whose factories place on the CPU.  Nothing happens on import or when CUDA is available, and
everything is restored on exit.  Megatron modules imported *after* :func:`enable` are not patched:
import Megatron first (``enable`` imports the modules it patches).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import threading
import types
from typing import Any, Callable, Iterator

import torch

_lock = threading.Lock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []


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


def _patches() -> list[tuple[Any, str, Any]]:
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
    ]
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
    return patches


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


def enable() -> None:
    """Start redirecting (nested calls count); a no-op when CUDA is available.  Pair with :func:`disable`."""
    global _depth
    if not needed():
        return
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        for owner, name, replacement in _patches():
            _saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, replacement)
        logging.getLogger(_RNG_LOGGER).addFilter(_filter)


def disable() -> None:
    """Undo :func:`enable` once every nested :func:`enable` has been undone."""
    global _depth
    if not needed():
        return
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth > 0:
            return
        logging.getLogger(_RNG_LOGGER).removeFilter(_filter)
        while _saved:
            owner, name, original = _saved.pop()
            setattr(owner, name, original)


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
