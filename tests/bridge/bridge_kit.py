"""Importing Megatron-Bridge's training loop on a machine without Transformer Engine or nvidia-resiliency-ext.

Bridge 0.6.2 imports both unconditionally in one place each: ``transformer_engine.pytorch`` in
``megatron.bridge.peft.lora_layers`` (LoRA layers for TE modules) and ``nvidia_resiliency_ext.inprocess``
(``CallWrapper``, an annotation) in ``megatron.bridge.training.pretrain``.  :func:`import_bridge` stands
in for them while exactly those two modules execute and removes the stand-ins from ``sys.modules`` right
after, so megatron-core (which picks its layers by whether TE imports) still sees no TE.  Using a
stand-in (a LoRA layer for TE, in-process restart) raises.  The NGC container has both for real.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import Any

# importer module -> the modules it needs that are absent here
_STANDINS = {
    "megatron.bridge.peft.lora_layers": ("transformer_engine", "transformer_engine.pytorch"),
    "megatron.bridge.training.pretrain": ("nvidia_resiliency_ext", "nvidia_resiliency_ext.inprocess"),
}


class _Absent:
    """A class from a module that is not installed: naming it works, using it raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{type(self).__qualname__} is a stand-in (the package is not installed)")


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _StandInModule(f"{self.__name__}.{name}") if name.islower() else type(name, (_Absent,), {})
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, needs: tuple[str, ...]) -> None:
        self.inner, self.needs = inner, needs

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        added = [name for name in self.needs if importlib.util.find_spec(name.split(".")[0]) is None]
        for name in added:
            sys.modules[name] = _StandInModule(name)
        try:
            self.inner.exec_module(module)
        finally:
            for name in added:
                sys.modules.pop(name, None)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _STANDINS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = _Loader(spec.loader, _STANDINS[fullname])
                return spec
        return None


def bridge_available() -> str | None:
    """``None`` when ``megatron.bridge`` is installed; else why the Bridge tests skip."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
        return ("megatron.bridge is not installed (make test-bridge installs it in .venv-bridge and runs "
                "these tests there)")
    return None


def import_bridge() -> None:
    """Import Bridge's training loop with the two stand-ins (megatron-core imported first, without them)."""
    import megatron.core  # noqa: F401
    import megatron.training.training  # noqa: F401

    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    importlib.import_module("megatron.bridge.training.pretrain")
    importlib.import_module("megatron.bridge.training.gpt_step")
