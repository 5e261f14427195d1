"""Package attributes imported on first use (a leaf): a package keeps its public names without importing
what they need (torch, Megatron) until one is read."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def attributes(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``where`` maps each name to the module holding it (absolute,
    or relative to ``package``)."""

    def __getattr__(name: str) -> Any:
        if name in where:
            return getattr(importlib.import_module(where[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
