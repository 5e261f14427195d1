"""One walker over Megatron's spec trees: a structural copy in which a rule may replace any submodule entry.

Specs nest as ``ModuleSpec`` / submodule dataclasses / ``functools.partial`` / lists, tuples and dicts, and
share subtrees (one layer spec for every layer); the copy keeps that sharing.  :func:`walk_spec` serves
putting ContextParallelAttention in (:mod:`.spec`), the tiled MLP (:mod:`.memory_spec`) and counting.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

KEEP = object()  # a rule's answer: leave the entry as it is and walk into it

# rule(submodules, field name, entry) -> the new entry, or KEEP
Rule = Callable[[Any, str, Any], Any]


def is_module_spec(obj: Any) -> bool:
    from megatron.core.transformer.spec_utils import ModuleSpec

    return isinstance(obj, ModuleSpec)


def built_class(entry: Any) -> Any:
    """The class a submodule entry builds (ModuleSpec / partial / class / TE placeholder)."""
    while True:
        if isinstance(entry, functools.partial):
            entry = getattr(entry.func, "__self__", entry.func)  # a classmethod builder: its class
        elif is_module_spec(entry):
            entry = entry.module
        else:
            return entry


class _Walk:
    def __init__(self, rule: Rule, each_module_spec: Optional[Callable[[Any], None]] = None) -> None:
        self.rule = rule
        self.each_module_spec = each_module_spec
        self.hits = 0
        self.memo: dict[int, Any] = {}

    def __call__(self, obj: Any) -> Any:
        if id(obj) in self.memo:
            return self.memo[id(obj)]
        out = self._copy(obj)
        self.memo[id(obj)] = out
        return out

    def _copy(self, obj: Any) -> Any:
        if isinstance(obj, (list, tuple)) and not _is_namedtuple(obj):
            return type(obj)(self(x) for x in obj)
        if isinstance(obj, dict):
            return {k: self(v) for k, v in obj.items()}
        if isinstance(obj, functools.partial):
            return functools.partial(obj.func, *(self(a) for a in obj.args),
                                     **{k: self(v) for k, v in obj.keywords.items()})
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return self._copy_dataclass(obj)
        return obj  # classes, functions, enums, TE placeholders, scalars: shared

    def _copy_dataclass(self, obj: Any) -> Any:
        if is_module_spec(obj):
            # params are constructor arguments (plain values): copied shallowly, never walked
            changes = {"params": dict(obj.params), "submodules": self(obj.submodules)}
            if isinstance(getattr(obj, "metainfo", None), dict):
                changes["metainfo"] = dict(obj.metainfo)
            out = dataclasses.replace(obj, **changes)
            if self.each_module_spec is not None:
                self.each_module_spec(out)
            return out
        changes = {}
        for f in dataclasses.fields(obj):
            if not f.init:
                continue
            value = getattr(obj, f.name)
            new = self.rule(obj, f.name, value)
            if new is KEEP:
                changes[f.name] = self(value)
            else:
                changes[f.name] = new
                self.hits += 1
        return dataclasses.replace(obj, **changes)


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def walk_spec(spec: Any, rule: Rule, each_module_spec: Optional[Callable[[Any], None]] = None) -> tuple[Any, int]:
    """A copy of ``spec`` with every submodule entry ``rule`` answers for replaced; and how many were.
    ``each_module_spec`` is called once with every ``ModuleSpec`` of the copy, which it may edit."""
    walk = _Walk(rule, each_module_spec)
    out = walk(spec)
    return out, walk.hits
