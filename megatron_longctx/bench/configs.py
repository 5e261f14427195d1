"""The configurations the regression benchmark puts side by side, and whether each can run here.

Baseline Megatron is the local layer spec at CP=1 (its local attention refuses CP>1 without Transformer
Engine), with and without Megatron's own full recompute.  The plugin runs at CP = world size with each
CP algorithm, then with the memory features (checkpoint offload, tiled MLP / loss) on top of ring.
A configuration whose feature is missing or refuses this layout is reported as
``unavailable: <reason>`` instead of failing the benchmark.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_longctx.megatron.training import Variant

BASELINE = "baseline"

# Memory features, as --longctx-* field values (MemoryConfig).
OFFLOAD = (("recompute_granularity", "full"), ("offload_policy", "checkpoint"))
TILED = (("tiled_mlp_tiles", 4), ("tiled_loss_tiles", 4))


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmarked configuration: a :class:`Variant` plus what it needs."""

    name: str
    description: str
    variant: Variant
    min_cp: int = 1  # the smallest CP size the algorithm needs

    def as_dict(self) -> dict[str, Any]:
        v = dataclasses.asdict(self.variant)
        v["longctx_options"] = dict(self.variant.longctx_options)
        return {"name": self.name, "description": self.description, "variant": v}


def default_configs(cp: int) -> list[BenchConfig]:
    """Every configuration for ``cp`` context-parallel ranks (the benchmark's world size)."""

    def plugin(name: str, algorithm: str, extra: tuple = (), desc: str = "", min_cp: int = 2) -> BenchConfig:
        options = (("cp_algorithm", algorithm),) + extra
        if algorithm == "hybrid":
            options += (("cp_ulysses_size", 2),)
        return BenchConfig(name, desc or f"plugin, CP={cp}, {algorithm}",
                           Variant(name=name, context_parallel_size=cp, plugin=True, longctx_options=options),
                           min_cp=min_cp)

    return [
        BenchConfig(BASELINE, "Megatron local spec, CP=1", Variant(name=BASELINE)),
        BenchConfig("baseline+recompute", "Megatron local spec, CP=1, Megatron full recompute",
                    Variant(name="baseline+recompute", megatron_recompute=True)),
        plugin("ring", "ring"),
        plugin("allgather", "allgather"),
        plugin("ulysses", "ulysses"),
        plugin("hybrid", "hybrid", min_cp=4, desc=f"plugin, CP={cp}, Ulysses(2) x ring"),
        plugin("ring+offload", "ring", OFFLOAD, f"plugin, CP={cp}, ring, full recompute + checkpoint offload"),
        plugin("ring+tiled", "ring", TILED, f"plugin, CP={cp}, ring, tiled MLP + tiled loss (4 tiles)"),
        plugin("ring+all", "ring", OFFLOAD + TILED,
               f"plugin, CP={cp}, ring, recompute + checkpoint offload + tiled MLP/loss"),
    ]


def unavailable_reason(config: BenchConfig, cp: int, num_query_groups: int) -> Optional[str]:
    """Why ``config`` cannot run here (``None`` when it can): missing feature code or an unfit layout."""
    variant = config.variant
    if not variant.plugin:
        return None
    if cp < config.min_cp:
        return f"needs CP >= {config.min_cp}, the benchmark runs CP={cp} (launch with --nproc-per-node {config.min_cp})"
    options = variant.options()
    if options.get("cp_algorithm") == "ulysses" and num_query_groups % cp:
        return f"Ulysses splits heads: --num-query-groups {num_query_groups} is not a multiple of CP={cp}"
    try:
        from megatron_longctx import apply_to_spec  # noqa: F401
        from megatron_longctx.config import LongContextConfig

        cfg = LongContextConfig.from_flat(options)
    except (ImportError, AttributeError) as exc:
        return f"plugin code missing ({type(exc).__name__}: {exc})"
    except ValueError as exc:
        return f"invalid options ({exc})"
    if cfg.memory.any_enabled:
        try:
            from megatron_longctx.memory import apply_memory_to_layer_spec, install  # noqa: F401
        except (ImportError, AttributeError) as exc:
            return f"memory features missing ({type(exc).__name__}: {exc})"
    return None


def select(configs: list[BenchConfig], names: Optional[list[str]]) -> list[BenchConfig]:
    """The configurations named in ``names`` (all when ``None``); the baseline is always included first."""
    if not names:
        return configs
    known = {c.name: c for c in configs}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--configs: unknown configuration(s) {unknown}; choose from {', '.join(known)}")
    chosen = [BASELINE] + [n for n in names if n != BASELINE]
    return [known[n] for n in chosen]
