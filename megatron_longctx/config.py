"""Typed configuration of megatron-longctx: one frozen dataclass per feature, flag = field name.

Each field of a feature dataclass listed in :data:`FEATURES` becomes the command-line flag
``--longctx-<field-with-dashes>`` (see :mod:`megatron_longctx.megatron.args`); ``__post_init__``
validates and every error names that flag and the fix.  Field names are unique across features, so
a flat ``{field: value}`` mapping (parsed flags, ``apply_to_spec(**options)``) maps back to exactly
one feature.  :class:`LongContextConfig` composes the features and checks the combinations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Mapping

from megatron_longctx.flags import flag_error as _err
from megatron_longctx.flags import flag_name  # noqa: F401 - part of this module's API
from megatron_longctx.memory.config import MemoryConfig

# The algorithms of megatron_longctx.attention; "auto" follows Megatron's own --cp-comm-type.
CP_ALGORITHMS = ("auto", "ring", "allgather", "ulysses", "hybrid")

# Megatron's --cp-comm-type values and the algorithm that serves each.
CP_COMM_TYPE_TO_ALGORITHM = {
    "p2p": "ring",
    "all_gather": "allgather",
    "allgather": "allgather",
    "a2a": "ulysses",
    "a2a+p2p": "hybrid",
}


@dataclasses.dataclass(frozen=True)
class ContextParallelConfig:
    """Context-parallel attention (ring: Liu et al. 2023, arXiv:2310.01889; Ulysses: arXiv:2309.14509)."""

    cp_algorithm: str = field(
        default="auto",
        metadata={"help": "CP attention algorithm: auto (follow --cp-comm-type: p2p=ring, all_gather=allgather, "
                          "a2a=ulysses, a2a+p2p=hybrid) | ring | allgather | ulysses | hybrid"},
    )
    cp_kernel_backend: str = field(
        default="auto",
        metadata={"help": "block attention kernel backend (auto = best available for the device), "
                          "e.g. reference | cpu_flash | sdpa_cuda | flash_attn"},
    )
    cp_ulysses_size: int = field(
        default=0,
        metadata={"help": "hybrid algorithm: size of the all-to-all (Ulysses) sub-group; "
                          "0 = first entry of --hierarchical-context-parallel-sizes"},
    )

    def __post_init__(self) -> None:
        if self.cp_algorithm not in CP_ALGORITHMS:
            raise _err("cp_algorithm", f"got {self.cp_algorithm!r}; choose one of {', '.join(CP_ALGORITHMS)}")
        if not isinstance(self.cp_kernel_backend, str) or not self.cp_kernel_backend:
            raise _err("cp_kernel_backend", f"got {self.cp_kernel_backend!r}; give a backend name or 'auto'")
        size = self.cp_ulysses_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _err("cp_ulysses_size", f"got {size!r}; give an integer >= 0 (0 = from "
                                          "--hierarchical-context-parallel-sizes)")

    @property
    def backend(self) -> str | None:
        """The kernel backend to ask for, ``None`` for automatic selection."""
        return None if self.cp_kernel_backend == "auto" else self.cp_kernel_backend


# The feature dataclasses whose fields become --longctx-* flags, with the LongContextConfig attribute.
FEATURES: tuple[tuple[str, type], ...] = (("cp", ContextParallelConfig), ("memory", MemoryConfig))


def _field_owner() -> dict[str, str]:
    owner: dict[str, str] = {}
    for attr, cls in FEATURES:
        for f in dataclasses.fields(cls):
            if f.name in owner:
                raise TypeError(f"config field {f.name!r} is defined by both {owner[f.name]} and {attr}; "
                                "field names must be unique across features (they are flag names)")
            owner[f.name] = attr
    return owner


_FIELD_OWNER = _field_owner()


@dataclasses.dataclass(frozen=True)
class LongContextConfig:
    """All megatron-longctx features together; validates combinations across features."""

    cp: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.cp, ContextParallelConfig):
            raise TypeError(f"LongContextConfig.cp must be a ContextParallelConfig, got {type(self.cp).__name__}")
        if not isinstance(self.memory, MemoryConfig):
            raise TypeError(f"LongContextConfig.memory must be a MemoryConfig, got {type(self.memory).__name__}")
        if self.cp.cp_ulysses_size and self.cp.cp_algorithm not in ("auto", "hybrid"):
            raise _err("cp_ulysses_size", f"only applies to the hybrid algorithm, but --longctx-cp-algorithm is "
                                          f"{self.cp.cp_algorithm!r}; drop it or choose hybrid")

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> "LongContextConfig":
        """Build from ``{field_name: value}`` across all features; unknown names are a ``ValueError``."""
        unknown = sorted(set(values) - set(_FIELD_OWNER))
        if unknown:
            known = ", ".join(sorted(_FIELD_OWNER))
            raise ValueError(f"unknown megatron-longctx option(s) {unknown}; known options: {known}")
        parts: dict[str, dict[str, Any]] = {attr: {} for attr, _ in FEATURES}
        for name, value in values.items():
            parts[_FIELD_OWNER[name]][name] = value
        return cls(**{attr: cls_(**parts[attr]) for attr, cls_ in FEATURES})

    def flat(self) -> dict[str, Any]:
        """``{field_name: value}`` of every feature (the inverse of :meth:`from_flat`)."""
        out: dict[str, Any] = {}
        for attr, _ in FEATURES:
            out.update(dataclasses.asdict(getattr(self, attr)))
        return out
