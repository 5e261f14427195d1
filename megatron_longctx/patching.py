"""One way to replace an attribute of someone else's object: :func:`patch` records what, where and why, and
its :meth:`Patch.undo` puts back exactly what was there.

Every feature that changes a built module (a ``forward`` that runs tiled, recomputed or lean, a method of
Megatron's ``GPTModel`` the tiled loss takes over) goes through it, so :func:`active` can say what is
patched right now and every undo follows the same rule: a patch is undone only while it is still the
attribute's value (a later patch on top is never clobbered).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

_MISSING = object()
_LIVE: "weakref.WeakSet[Patch]" = weakref.WeakSet()


@dataclasses.dataclass(eq=False)
class Patch:
    """``owner.name`` replaced by ``replacement`` for ``reason``; :meth:`undo` restores it."""

    owner: Any
    name: str
    replacement: Any
    reason: str
    _before: Any = _MISSING  # the owner's own attribute (in its __dict__) before the patch, if it had one

    @property
    def applied(self) -> bool:
        return vars(self.owner).get(self.name, _MISSING) is self.replacement

    def undo(self) -> None:
        """Restore the attribute; a no-op when undone already or when another patch replaced this one."""
        if not self.applied:
            return
        if self._before is _MISSING:
            delattr(self.owner, self.name)  # the class's (or the type's) attribute shows through again
        else:
            setattr(self.owner, self.name, self._before)
        _LIVE.discard(self)

    def __enter__(self) -> "Patch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()


def patch(owner: Any, name: str, replacement: Any, reason: str, create: bool = False) -> Patch:
    """Set ``owner.name = replacement`` (on the instance, class or module itself) and return the
    :class:`Patch` that undoes it; usable as a context manager for a patch that lasts one call.
    ``create``: the attribute may be missing (the undo then removes it)."""
    if not reason:
        raise ValueError(f"patch({type(owner).__name__}.{name}): give the reason")
    before = vars(owner).get(name, _MISSING)
    if before is _MISSING and not create and not hasattr(owner, name):
        raise AttributeError(f"patch: {type(owner).__name__} has no attribute {name!r} to replace")
    setattr(owner, name, replacement)
    done = Patch(owner, name, replacement, reason, before)
    _LIVE.add(done)
    return done


def active() -> list[str]:
    """What is patched right now: ``"<owner type>.<name>: <reason>"`` per live patch."""
    return sorted(f"{type(p.owner).__name__}.{p.name}: {p.reason}" for p in list(_LIVE) if p.applied)
