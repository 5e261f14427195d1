"""The configurations the regression benchmark puts side by side, and whether each can run here.

Baselines are what a Megatron user runs without this plugin, at the same ranks and per-rank budget:

- ``megatron-unfused``: Megatron's local spec at CP=1 (its ``DotProductAttention`` materialises the
  ``s x s`` scores, and refuses CP>1 without Transformer Engine); the reference row for parity;
- ``megatron-flash``: CP=1 with a flash-class kernel (the plugin's, through Megatron's ``core_attention``)
  and a fused-class RMSNorm (``lean_norm``: saves its input and ``1/rms``), every other plugin memory
  feature off: what TE's flash attention and fused norm give on a GPU;
- ``megatron-flash+recompute``: the same with Megatron's best memory setting that runs here, full
  recompute, uniform, 1 layer (selective ``core_attn`` saves nothing once attention is flash-class,
  selective ``mlp``/``layernorm`` fail in Megatron without TE, see MEGATRON_NOTES);
- ``megatron-flash+cp`` and ``megatron-flash+cp+recompute``: CP at the plugin's CP size with the
  plugin's ring standing in for TE's, without and with Megatron's full recompute (what a Megatron+TE CP
  user has before this plugin's memory features).

The plugin runs at CP = world size with each CP algorithm, then with its memory features (checkpoint
offload, tiled MLP / loss) on top of ring, and with every layer's recompute replayed in sequence tiles
on top of all-gather (the tiled replay attends over K/V gathered once per layer).  A configuration whose feature is missing or refuses this
layout is reported as ``unavailable: <reason>`` instead of failing the benchmark.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_longctx import cp_algorithms as algorithms
from megatron_longctx.config import LongContextConfig
from megatron_longctx.bench.engine import Variant

REFERENCE = "megatron-unfused"  # the parity reference row (Megatron's own local spec)
FLASH_RECOMPUTE = "megatron-flash+recompute"  # the time-per-token reference of the goal

# Memory features, as --longctx-* field values (MemoryConfig).  The offloaded layer inputs leave the
# device: for host memory on a GPU; on a CPU-only process host memory *is* the device memory, so the
# stand-in is the disk (offload_target=disk), which is what lowers resident memory there.
OFFLOAD = (("recompute_granularity", "full"), ("offload_policy", "checkpoint"))
TILED = (("tiled_mlp_tiles", 4), ("tiled_loss_tiles", 4))
# With every memory feature on, the tiled loss recomputes its logits in backward: one matmul more per
# tile, nothing [s, h] or [V, h] held from forward to backward.
TILED_LEAN = TILED + (("tiled_loss_recompute", True),)
# Tiles sized per sequence (as ALST does): at most this many tokens per rank in one tile.  A feature tiles
# only from MIN_TILES tiles' worth of tokens per rank on: on a shorter sequence its extra passes (the
# logits recomputed, the layer replay's Q/K/V projections) cost more than the memory they save, and it
# is off (plain loss, plain MLP, plain full recompute).
MLP_TILE_TOKENS = 256
LOSS_TILE_TOKENS = 128
LAYER_TILE_TOKENS = 256  # layers replayed in sequence tiles
MIN_TILES = 4


def offload_options() -> tuple:
    import torch

    return OFFLOAD + (("offload_target", "host" if torch.cuda.is_available() else "disk"),)


def tiles_for(variant: Variant, tokens_per_rank: int) -> Variant:
    """``variant`` with its tile counts sized for ``tokens_per_rank`` (unchanged if untiled): as many tiles as
    each feature's tile size needs, from :data:`MIN_TILES` tiles on; fewer turn the feature off."""
    options = variant.options()
    sized = {"tiled_mlp_tiles": MLP_TILE_TOKENS, "tiled_loss_tiles": LOSS_TILE_TOKENS,
             "recompute_tiles": LAYER_TILE_TOKENS}
    for key, tile in sized.items():
        if options.get(key):
            tiles = -(-tokens_per_rank // tile)
            options[key] = tiles if tiles >= MIN_TILES else 0
    if not options.get("tiled_loss_tiles"):
        options.pop("tiled_loss_recompute", None)  # the plain loss: nothing to recompute
    if options.get("recompute_tiles", 0) <= 1:
        options.pop("offload_residual_grad", None)  # whole layers: their gradients are whole anyway
        options.pop("tiled_output_over_input", None)
    if options.get("recompute_tiles", 0) > 1 and options.get("tiled_mlp_tiles"):
        # Inside a replayed tile the MLP sees that tile only: its tiles are sized for it.
        layer_tile = -(-tokens_per_rank // options["recompute_tiles"])
        options["tiled_mlp_tiles"] = max(2, -(-layer_tile // MLP_TILE_TOKENS))
    return dataclasses.replace(variant, longctx_options=tuple(options.items()))


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """One benchmarked configuration: a :class:`Variant` plus what it needs."""

    name: str
    description: str
    variant: Variant
    min_cp: int = 1  # the smallest CP size the algorithm needs
    baseline: bool = False  # what Megatron gives without this plugin's algorithms and memory features

    def as_dict(self) -> dict[str, Any]:
        v = dataclasses.asdict(self.variant)
        v["longctx_options"] = dict(self.variant.longctx_options)
        return {"name": self.name, "description": self.description, "variant": v,
                "role": "baseline" if self.baseline else "plugin"}


def baseline_configs(cp: int) -> list[BenchConfig]:
    """Megatron without this plugin's contributions, at ``cp`` ranks (see the module docstring)."""
    # At CP=1 ring is one local flash-class kernel call; the lean norm keeps what TE's fused norm keeps.
    flash = (("cp_algorithm", "ring"), ("lean_norm", True))

    def mk(name: str, desc: str, **kw: Any) -> BenchConfig:
        return BenchConfig(name, desc, Variant(name=name, **kw), baseline=True)

    return [
        mk(REFERENCE, "Megatron local spec (unfused attention), CP=1"),
        mk("megatron-flash", "Megatron, flash-class attention, CP=1", plugin=True, longctx_options=flash),
        mk(FLASH_RECOMPUTE, "Megatron, flash-class attention, CP=1, full recompute (uniform, 1 layer)",
           plugin=True, longctx_options=flash, megatron_recompute=True),
        mk("megatron-flash+cp", f"Megatron, flash-class attention, CP={cp} ring", plugin=True,
           longctx_options=flash, context_parallel_size=cp),
        mk("megatron-flash+cp+recompute", f"Megatron, flash-class attention, CP={cp} ring, full recompute",
           plugin=True, longctx_options=flash, context_parallel_size=cp, megatron_recompute=True),
    ]


def default_configs(cp: int) -> list[BenchConfig]:
    """Every configuration for ``cp`` context-parallel ranks (the benchmark's world size)."""

    def plugin(name: str, algorithm: str, extra: tuple = (), desc: str = "", min_cp: int = 2) -> BenchConfig:
        options = (("cp_algorithm", algorithm), ("lean_norm", True)) + extra
        if algorithm == "hybrid":
            options += (("cp_ulysses_size", 2),)
        return BenchConfig(name, desc or f"plugin, CP={cp}, {algorithm}",
                           Variant(name=name, context_parallel_size=cp, plugin=True, longctx_options=options),
                           min_cp=min_cp)

    return baseline_configs(cp) + [
        plugin("allgather", "allgather"),
        plugin("ulysses", "ulysses"),
        plugin("hybrid", "hybrid", min_cp=4, desc=f"plugin, CP={cp}, Ulysses(2) x ring"),
        plugin("ring+offload", "ring", offload_options(),
               f"plugin, CP={cp}, ring, full recompute + checkpoint offload"),
        plugin("ring+tiled", "ring", TILED, f"plugin, CP={cp}, ring, tiled MLP + tiled loss "
               f"(<= {MLP_TILE_TOKENS} / {LOSS_TILE_TOKENS} tokens per tile, from {MIN_TILES} tiles' worth on)"),
        plugin("ring+all", "ring", offload_options() + TILED_LEAN,
               f"plugin, CP={cp}, ring, recompute + checkpoint offload + tiled MLP/loss (logits recomputed)"),
        plugin("allgather+all", "allgather",
               offload_options() + TILED_LEAN + (("recompute_tiles", 4), ("offload_residual_grad", True),
                                                 ("tiled_output_over_input", True)),
               f"plugin, CP={cp}, all-gather, recompute in sequence tiles (<= {LAYER_TILE_TOKENS} tokens per "
               f"tile, outputs over inputs) + checkpoint offload + residual gradient offload + tiled MLP/loss "
               f"(logits recomputed); "
               f"each tiles from {MIN_TILES} tiles' worth on"),
    ]


# Model-state offload rows: a plugin row with every parameter's weights, main gradients and Adam moments
# streamed per layer from host memory or disk (--longctx-model-state-offload).  They are searched on request
# (``--configs``/``--max-seq-configs``), and have their own headline (a model whose states are most of the
# budget, ``--preset llama-states``); the default sweep and headline leave them out.  Their activation
# features: ring's recompute + checkpoint offload (and the tiled MLP), or every feature of allgather+all.
MODEL_STATE_BASES = {"ring+offload": ("recompute + checkpoint offload", ()),
                     "ring+offload+mlp": ("recompute + checkpoint offload + tiled MLP", (("tiled_mlp_tiles", 4),)),
                     "allgather+all": ("allgather+all's features", None)}  # None: the default row's options
MODEL_STATE_TARGETS = ("disk", "host")


def model_state_configs(cp: int) -> list[BenchConfig]:
    """``<base>+states-<target>`` for each base of :data:`MODEL_STATE_BASES` and each target."""
    defaults = {c.name: c for c in default_configs(cp)}
    out = []
    for target in MODEL_STATE_TARGETS:
        for base, (what, extra) in MODEL_STATE_BASES.items():
            name = f"{base}+states-{target}"
            if extra is None:
                options = defaults[base].variant.longctx_options
            else:
                options = (("cp_algorithm", "ring"), ("lean_norm", True)) + offload_options() + extra
            algorithm = dict(options)["cp_algorithm"]
            options += (("model_state_offload", target),)
            out.append(BenchConfig(name, f"plugin, CP={cp}, {algorithm}, {what}; weights, main gradients and Adam "
                                         f"moments streamed per layer from {target} (--longctx-model-state-offload "
                                         f"{target})",
                                   Variant(name=name, context_parallel_size=cp, plugin=True, longctx_options=options),
                                   min_cp=2))
    return out


def all_configs(cp: int) -> list[BenchConfig]:
    """:func:`default_configs` and the model-state rows (:func:`model_state_configs`)."""
    return default_configs(cp) + model_state_configs(cp)


def streams_model_states(config: BenchConfig) -> bool:
    return config.variant.options().get("model_state_offload", "none") != "none"


def unfused_scores_bytes(shape: dict[str, Any], seq_length: int) -> int:
    """Bytes per rank the unfused attention keeps for backward: scores and probabilities, float32, every layer."""
    return 8 * shape["num_layers"] * shape["num_attention_heads"] * seq_length ** 2


def sweep_skip_reason(config: BenchConfig, shape: dict[str, Any], seq_length: int, limit_bytes: int) -> Optional[str]:
    """Why the sweep leaves out ``config`` at ``seq_length`` (the unfused scores would not fit a shared machine)."""
    if config.variant.plugin:
        return None
    need = unfused_scores_bytes(shape, seq_length)
    if need <= limit_bytes:
        return None
    return (f"skipped: unfused attention keeps ~{need / 2**30:.1f} GiB/rank of scores at this length "
            f"(over --sweep-mem-limit-mib {limit_bytes / 2**20:.0f})")


def unavailable_reason(config: BenchConfig, cp: int, num_query_groups: int) -> Optional[str]:
    """Why ``config`` cannot run here (``None`` when it can): a layout that does not fit, or invalid options."""
    variant = config.variant
    if not variant.plugin:
        return None
    if cp < config.min_cp:
        return f"needs CP >= {config.min_cp}, the benchmark runs CP={cp} (launch with --nproc-per-node {config.min_cp})"
    options = variant.options()
    if options.get("model_state_offload") == "host" and not _gpu():
        return ("--longctx-model-state-offload host keeps the model states in host memory, which on a CPU-only "
                "machine is the memory the ranks train in: run the +states-disk rows")
    algorithm = options.get("cp_algorithm", "auto")
    if algorithm != "auto" and algorithms.get(algorithm).heads == "all" and num_query_groups % cp:
        return f"{algorithm} splits heads: --num-query-groups {num_query_groups} is not a multiple of CP={cp}"
    try:
        LongContextConfig.from_flat(options)
    except ValueError as exc:
        return f"invalid options ({exc})"
    return None


def _gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def select(configs: list[BenchConfig], names: Optional[list[str]]) -> list[BenchConfig]:
    """The configurations named in ``names`` (all when ``None``); the reference row is always included first."""
    if not names:
        return configs
    known = {c.name: c for c in configs}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--configs: unknown configuration(s) {unknown}; choose from {', '.join(known)}")
    chosen = [REFERENCE] + [n for n in names if n != REFERENCE]
    return [known[n] for n in chosen]
