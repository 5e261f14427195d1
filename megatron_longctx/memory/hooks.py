"""One ``saved_tensors_hooks`` context that several packers share (offload, discard-and-recompute, accounting).

PyTorch honours only the innermost ``saved_tensors_hooks``; offload, selective recompute of norms and
accounting all want to see every tensor autograd saves.  A :class:`SavedTensorChain` is that one
context: it asks each registered :class:`Packer` in turn (innermost registration first) and the first
that claims the tensor packs it; a tensor nobody claims is stored as is.  Observers (accounting) see
every tensor and never claim.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional, Protocol

import torch


class Packer(Protocol):
    def pack(self, tensor: torch.Tensor) -> Optional[Any]:
        """A packed object, or None to leave the tensor to the next packer."""

    def unpack(self, packed: Any) -> torch.Tensor:
        """The tensor ``pack`` was given (same values, shape, dtype, device)."""


class RowPacker(Packer, Protocol):
    """A packer that can also hand back a saved tensor a range of rows (dim 0) at a time."""

    def pack_rows(self, tensor: torch.Tensor) -> Optional[Any]:
        """A packed object :meth:`unpack_rows` serves, or None to leave the tensor to the next packer."""

    def unpack_rows(self, packed: Any, lo: int, hi: int, ahead: Optional[tuple] = None) -> torch.Tensor:
        """Rows ``[lo, hi)`` of the packed tensor, alone (the other rows stay where they are); ``ahead``:
        ``(lo, hi)`` of the rows read next, which may start coming back now."""


class Observer(Protocol):
    def observe(self, tensor: torch.Tensor, packed_by: Optional[Packer]) -> None:
        """Called for every saved tensor, after the packers (``packed_by`` None: stored as is)."""


_state = threading.local()


# ------------------------------------------------------------------ where in the model we are
# The model wiring opens these scopes; packers and observers read them.


@contextlib.contextmanager
def layer_scope(index: int) -> Iterator[None]:
    """Tensors saved inside belong to transformer layer ``index`` (0-based within this stage)."""
    _packers()
    outer, _state.layer = getattr(_state, "layer", None), index
    try:
        yield
    finally:
        _state.layer = outer


@contextlib.contextmanager
def module_scope(name: str) -> Iterator[None]:
    """Tensors saved inside belong to the named part (``core_attn``, ``mlp``, ...) of the current layer."""
    _packers()
    modules = _state.__dict__.setdefault("modules", [])
    modules.append(name)
    try:
        yield
    finally:
        modules.pop()


def current_layer() -> Optional[int]:
    return getattr(_state, "layer", None)


def current_modules() -> tuple:
    return tuple(getattr(_state, "modules", ()))


def _packers() -> list:
    if not hasattr(_state, "packers"):
        _state.packers, _state.observers, _state.depth = [], [], 0
    return _state.packers


def _pack(tensor: torch.Tensor) -> tuple[Optional[Packer], Any]:
    item: tuple[Optional[Packer], Any] = (None, tensor)
    for packer in reversed(_state.packers):
        packed = packer.pack(tensor)
        if packed is not None:
            item = (packer, packed)
            break
    for observer in _state.observers:
        observer.observe(tensor, item[0])
    return item


def _unpack(item: tuple[Optional[Packer], Any]) -> torch.Tensor:
    packer, packed = item
    return packed if packer is None else packer.unpack(packed)


def pack_rows(tensor: torch.Tensor) -> Optional[tuple]:
    """``tensor`` packed by the innermost packer that claims it, if that packer serves it row by row.

    For a tensor its owner will read back in row ranges (a layer replayed in sequence tiles): the item
    for :func:`unpack_rows`, or None when the tensor is to be saved as usual (no chain active, another
    ``saved_tensors_hooks`` is innermost, or the first packer that could claim it cannot serve rows).
    """
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if not getattr(_state, "depth", 0) or top is None or top[0] is not _pack:
        return None
    for packer in reversed(_state.packers):
        rows = getattr(packer, "pack_rows", None)
        if rows is None:
            return None  # it might claim the tensor: save_for_backward asks it
        packed = rows(tensor)
        if packed is not None:
            for observer in _state.observers:
                observer.observe(tensor, packer)
            return packer, packed
    return None


def wait_stored(item: tuple) -> bool:
    """Wait until the tensor :func:`pack_rows` packed as ``item`` may be overwritten (its bytes are off
    its memory); False when its packer cannot tell."""
    packer, packed = item
    wait = getattr(packer, "wait_stored", None)
    if wait is None:
        return False
    wait(packed)
    return True


def unpack_rows(item: tuple, lo: int, hi: int, ahead: Optional[tuple] = None) -> torch.Tensor:
    """Rows ``[lo, hi)`` of a tensor :func:`pack_rows` packed (``ahead``: the rows read next)."""
    packer, packed = item
    return packer.unpack_rows(packed, lo, hi, ahead)


@contextlib.contextmanager
def _chain_active() -> Iterator[None]:
    _packers()
    _state.depth += 1
    try:
        if _state.depth == 1:
            with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                yield
        else:
            yield
    finally:
        _state.depth -= 1


@contextlib.contextmanager
def packing(packer: Packer) -> Iterator[None]:
    """Route tensors saved for backward inside the block through ``packer`` (before outer packers)."""
    packers = _packers()
    packers.append(packer)
    try:
        with _chain_active():
            yield
    finally:
        packers.remove(packer)


@contextlib.contextmanager
def observing(observer: Observer) -> Iterator[None]:
    """Show every tensor saved for backward inside the block to ``observer``."""
    _packers()
    _state.observers.append(observer)
    try:
        with _chain_active():
            yield
    finally:
        _state.observers.remove(observer)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No packer or observer sees the tensors saved inside the block (e.g. a recompute in backward)."""
    _packers()
    saved = (_state.packers, _state.observers, _state.depth)
    _state.packers, _state.observers, _state.depth = [], [], 0
    try:
        yield
    finally:
        _state.packers, _state.observers, _state.depth = saved
