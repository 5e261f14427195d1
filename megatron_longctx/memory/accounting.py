"""Measure activation memory: bytes autograd saves, per layer and module; peak device/host memory.

:class:`SavedTensorAccountant` observes every tensor saved for backward (through
:mod:`megatron_longctx.memory.hooks`) and files its bytes under the layer/module scope the model
wiring opened; storages are counted once (views and tensors several layers share), parameters never.
Tensors an offload packer claimed are counted apart: they no longer occupy the device.
:class:`PeakMemory` reports the peak CUDA allocation on GPU, or the peak resident set size on CPU.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import resource
import threading
import time
import weakref
from typing import Any, Optional

import torch

from megatron_longctx.memory import hooks
from megatron_longctx.procs import memory_kib


@dataclasses.dataclass
class SavedBytes:
    """Saved-activation bytes by scope key ``(layer, module)`` (layer None: outside any layer)."""

    resident: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(int))
    offloaded: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(int))

    @property
    def resident_total(self) -> int:
        return sum(self.resident.values())

    @property
    def offloaded_total(self) -> int:
        return sum(self.offloaded.values())

    def per_layer(self) -> dict:
        """Resident bytes summed per layer index (None: embedding, loss and other non-layer tensors)."""
        out: dict = collections.defaultdict(int)
        for (layer, _), n in self.resident.items():
            out[layer] += n
        return dict(out)


class SavedTensorAccountant:
    """``with SavedTensorAccountant(model) as acc: loss = model(...)``; then read ``acc.saved``.

    Args:
        model: its parameters (and views of them) are never counted.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None) -> None:
        self.saved = SavedBytes()
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
        self._seen: set = set()
        self._seen_offloaded: dict = {}
        self._cm: Any = None
        self._model = model
        self._handles: list = []

    def _scope_hooks(self) -> None:
        """Open layer/module scopes around a plain model's layers (install() opens its own too)."""
        layer_index = 0
        for module in self._model.modules() if self._model is not None else ():
            if type(module).__name__ != "TransformerLayer" and not type(module).__name__.endswith("TransformerLayer"):
                continue
            self._add_scope(module, lambda i=layer_index: hooks.layer_scope(i))
            for name, path in _ACCOUNTED_MODULES:
                sub = module
                for part in path.split("."):
                    sub = getattr(sub, part, None)
                if isinstance(sub, torch.nn.Module):
                    self._add_scope(sub, lambda n=name: hooks.module_scope(n))
            layer_index += 1

    def _add_scope(self, module: torch.nn.Module, make: Any) -> None:
        stack: list = []

        def pre(*_: Any) -> None:
            cm = make()
            cm.__enter__()
            stack.append(cm)

        def post(*_: Any) -> None:
            if stack:
                stack.pop().__exit__(None, None, None)

        self._handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def observe(self, tensor: torch.Tensor, packed_by: Any) -> None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if isinstance(tensor, torch.nn.Parameter) or ptr in self._params or ptr == 0:
            return
        claimed = packed_by is not None and type(packed_by).__name__ == "ActivationOffloader"
        if packed_by is not None and not claimed:  # packed as a recipe: recomputed, not stored
            return
        if claimed:  # its storage may be freed (and the address reused) once the copy has landed
            ref = self._seen_offloaded.get(ptr)
            if ref is not None and ref() is not None:
                return
            self._seen_offloaded[ptr] = weakref.ref(tensor)
        else:  # autograd keeps a resident storage alive: its address stays unique while we count
            if ptr in self._seen:
                return
            self._seen.add(ptr)
        modules = hooks.current_modules()
        key = (hooks.current_layer(), modules[-1] if modules else None)
        target = self.saved.offloaded if claimed else self.saved.resident
        target[key] += storage.nbytes()

    def __enter__(self) -> "SavedTensorAccountant":
        self._scope_hooks()
        self._cm = hooks.observing(self)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cm.__exit__(*exc)
        self._cm = None
        while self._handles:
            self._handles.pop().remove()


# Parts of a TransformerLayer the accountant files bytes under (the names Megatron users use).
_ACCOUNTED_MODULES = (
    ("layernorm", "input_layernorm"),
    ("qkv", "self_attention.linear_qkv"),
    ("core_attn", "self_attention.core_attention"),
    ("proj", "self_attention.linear_proj"),
    ("layernorm", "pre_mlp_layernorm"),
    ("mlp", "mlp"),
)

# Environment for a process whose sampled RSS should follow its live tensors: a fixed glibc mmap
# threshold returns every freed block of 64 KiB or more to the OS at once (read at process start).
RSS_TRACKS_TENSORS_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 16)}


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc), so the starting RSS is what is really in use."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    """This process's resident set size (CPU memory in use)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes(reset: bool = False) -> int:
    """This process's peak resident set size (the kernel's ``VmHWM``) since it started or since the last
    ``reset`` (``/proc/self/clear_refs``; where that cannot be written the peak keeps counting from the
    start, never lower than the true peak since the reset)."""
    peak = memory_kib(os.getpid())[1] * 1024
    if reset:
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size to the current one
    return peak


class PeakMemory:
    """Peak memory over a block: CUDA ``max_memory_allocated`` on GPU, sampled RSS on CPU.

    ``peak_bytes`` is the peak; ``start_bytes`` what was in use when the block began, so
    ``peak_bytes - start_bytes`` is what the block added.  On CPU the RSS is sampled every
    ``interval_s`` by a background thread (and the kernel's ``ru_maxrss`` high-water mark, when it was
    reached inside the block, bounds it from above).
    """

    def __init__(self, device: Optional[torch.device] = None, interval_s: float = 0.002) -> None:
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        self.interval_s = interval_s
        self.start_bytes = self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, rss_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = self.peak_bytes = torch.cuda.memory_allocated(self.device)
        else:
            _trim_heap()
            self.start_bytes = self.peak_bytes = rss_bytes()
            self._ru_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
            return
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, rss_bytes())
        ru_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if ru_after > self._ru_before:  # the process high-water mark was set inside the block
            self.peak_bytes = max(self.peak_bytes, ru_after)

    @property
    def added_bytes(self) -> int:
        return self.peak_bytes - self.start_bytes
