"""Typed configuration of megatron-longctx: one frozen dataclass per feature, flag = field name.

Each field of a feature dataclass listed in :data:`FEATURES` becomes the command-line flag
``--longctx-<field-with-dashes>`` (:func:`flag_name`, see :mod:`megatron_longctx.megatron.arguments`),
except the fields whose job a Megatron flag already does (:data:`MEGATRON_FLAGS`).  A field with a
fixed set of values is annotated ``Literal[...]``: the parser offers exactly those values and
``__post_init__`` checks them (:func:`choices`).  ``__post_init__`` validates and every error names the
flag and the fix (:func:`flag_error`).  Field names are unique across features, so a flat
``{field: value}`` mapping (parsed flags, ``apply_to_spec(**options)``) maps back to exactly one
feature.  :class:`LongContextConfig` composes the features and checks the combinations.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import field
from typing import Any, Literal

from megatron_longctx import cp_algorithms as algorithms

# The registry's algorithms, and "auto": follow Megatron's own --cp-comm-type.
CpAlgorithm = Literal[("auto", *algorithms.NAMES)]  # type: ignore[valid-type]
OffloadPolicy = Literal["none", "checkpoint", "modules", "layers"]
OffloadTarget = Literal["host", "disk"]
RecomputeGranularity = Literal["none", "full", "selective"]
RecomputeMethod = Literal["uniform", "block"]
# Names a Megatron user gives to the parts of a transformer layer (selective recompute, module offload).
LayerModule = Literal["core_attn", "qkv", "proj", "mlp", "layernorm"]

OFFLOAD_POLICIES: tuple[str, ...] = typing.get_args(OffloadPolicy)
OFFLOAD_TARGETS: tuple[str, ...] = typing.get_args(OffloadTarget)
RECOMPUTE_GRANULARITIES: tuple[str, ...] = typing.get_args(RecomputeGranularity)
RECOMPUTE_METHODS: tuple[str, ...] = typing.get_args(RecomputeMethod)
RECOMPUTE_MODULE_NAMES: tuple[str, ...] = typing.get_args(LayerModule)
OFFLOAD_MODULE_NAMES: tuple[str, ...] = typing.get_args(LayerModule)

# Config field -> the Megatron-LM flag it is read from (no --longctx-* flag for these).
MEGATRON_FLAGS = {
    "recompute_granularity": "--recompute-granularity",
    "recompute_method": "--recompute-method",
    "recompute_num_layers": "--recompute-num-layers",
    "recompute_modules": "--recompute-modules",
    "distributed_optimizer": "--use-distributed-optimizer",
}


def flag_name(field_name: str) -> str:
    """The command-line flag of a config field: ``cp_algorithm`` -> ``--longctx-cp-algorithm``
    (``recompute_granularity`` -> Megatron's ``--recompute-granularity``)."""
    return MEGATRON_FLAGS.get(field_name) or "--longctx-" + field_name.replace("_", "-")


def flag_error(field_name: str, message: str) -> ValueError:
    """A ``ValueError`` that names the flag of ``field_name``, then says what is wrong and the fix."""
    return ValueError(f"{flag_name(field_name)}: {message}")


def _literal_values(hint: Any) -> tuple | None:
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else None


@functools.cache
def choices(cls: type) -> dict[str, tuple]:
    """``{field: allowed values}`` of the fields of ``cls`` annotated ``Literal[...]``."""
    hints = typing.get_type_hints(cls)
    return {f.name: v for f in dataclasses.fields(cls) if (v := _literal_values(hints[f.name])) is not None}


@functools.cache
def item_choices(cls: type) -> dict[str, tuple]:
    """``{field: allowed items}`` of the fields of ``cls`` annotated ``tuple[Literal[...], ...]``."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        args = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is tuple else ()
        if args and (values := _literal_values(args[0])) is not None:
            out[f.name] = values
    return out


def _check_choices(config: Any) -> None:
    """Every ``Literal`` field of ``config`` holds one of its values, every item of a ``tuple[Literal]`` too."""
    cls = type(config)
    for name, allowed in choices(cls).items():
        if getattr(config, name) not in allowed:
            raise flag_error(name, f"got {getattr(config, name)!r}; choose one of {', '.join(allowed)}")
    for name, allowed in item_choices(cls).items():
        unknown = [m for m in getattr(config, name) if m not in allowed]
        if unknown:
            raise flag_error(name, f"unknown module(s) {unknown}; choose from {', '.join(allowed)}")


@dataclasses.dataclass(frozen=True)
class ContextParallelConfig:
    """Context-parallel attention (ring: Liu et al. 2023, arXiv:2310.01889; Ulysses: arXiv:2309.14509)."""

    cp_algorithm: CpAlgorithm = field(
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
        _check_choices(self)
        if not isinstance(self.cp_kernel_backend, str) or not self.cp_kernel_backend:
            raise flag_error("cp_kernel_backend", f"got {self.cp_kernel_backend!r}; give a backend name or 'auto'")
        size = self.cp_ulysses_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise flag_error("cp_ulysses_size", f"got {size!r}; give an integer >= 0 (0 = from "
                                                "--hierarchical-context-parallel-sizes)")

    @property
    def backend(self) -> str | None:
        """The kernel backend to ask for, ``None`` for automatic selection."""
        return None if self.cp_kernel_backend == "auto" else self.cp_kernel_backend


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """Activation-memory features: offload, recompute, tiled MLP, tiled loss (ALST, arXiv:2506.13996;
    MsT, arXiv:2407.15892).

    The ``recompute_*`` fields are no ``--longctx-*`` flags: Megatron's own ``--recompute-*`` flags fill
    them with the part of Megatron's recompute that the plugin runs
    (:func:`megatron_longctx.megatron.arguments.config_from_args`).
    """

    offload_policy: OffloadPolicy = field(
        default="none",
        metadata={"help": "activation offload: none | checkpoint (layer inputs under full recompute) | "
                          "modules (named modules' saved tensors) | layers (all saved tensors of the first N layers)"},
    )
    offload_target: OffloadTarget = field(
        default="host", metadata={"help": "where offloaded activations go: host (pinned memory pool) | disk (files)"}
    )
    offload_modules: tuple[LayerModule, ...] = field(
        default=("core_attn", "mlp"),
        metadata={"help": "modules whose saved tensors are offloaded under offload_policy=modules "
                          f"({', '.join(OFFLOAD_MODULE_NAMES)})"},
    )
    offload_num_layers: int = field(
        default=0, metadata={"help": "offload_policy=layers: offload everything saved in the first N layers (0 = all)"}
    )
    offload_min_bytes: int = field(
        default=1 << 16, metadata={"help": "tensors smaller than this many bytes are never offloaded"}
    )
    offload_host_pool_bytes: int = field(
        default=8 << 30,
        metadata={"help": "bound of the host (pinned) pool; tensors beyond it stay on the device and are counted"},
    )
    offload_disk_dir: str | None = field(
        default=None, metadata={"help": "directory for offload_target=disk (default: a fresh temporary directory)"}
    )
    offload_max_inflight: int = field(
        default=4, metadata={"help": "most asynchronous offload copies / file writes in flight at once"}
    )
    offload_prefetch: bool = field(
        default=True, metadata={"help": "during backward, fetch the next layer's tensors while this layer runs"}
    )
    recompute_granularity: RecomputeGranularity = field(
        default="none", metadata={"help": "activation recompute run by the plugin: none | full (whole layers) | "
                                          "selective (named modules); from Megatron's --recompute-granularity"}
    )
    recompute_method: RecomputeMethod = field(
        default="uniform", metadata={"help": "full recompute: uniform (every layer) | block (first N layers); "
                                             "from Megatron's --recompute-method"}
    )
    recompute_num_layers: int = field(
        default=0, metadata={"help": "full recompute with method=block: how many layers (0 = all layers); "
                                     "from Megatron's --recompute-num-layers"}
    )
    recompute_modules: tuple[LayerModule, ...] = field(
        default=("core_attn",),
        metadata={"help": f"selective recompute: modules to recompute ({', '.join(RECOMPUTE_MODULE_NAMES)}); "
                          "from Megatron's --recompute-modules"},
    )
    recompute_tiles: int = field(
        default=0,
        metadata={"help": "full recompute: replay each layer in this many sequence tiles, attention over K/V "
                          "gathered once per layer (needs the all-gather CP algorithm; 0 or 1 = off)"},
    )
    tiled_mlp_tiles: int = field(
        default=0, metadata={"help": "run each MLP over this many sequence tiles (0 or 1 = off)"}
    )
    tiled_loss_tiles: int = field(
        default=0,
        metadata={"help": "compute output logits and cross-entropy over this many sequence tiles (0 or 1 = off)"},
    )
    tiled_loss_recompute: bool = field(
        default=False,
        metadata={"help": "tiled loss: recompute each tile's logits in backward (4 matmuls per tile, not 3) instead "
                          "of running the tile's backward inside forward; nothing hidden- or vocabulary-sized is "
                          "held from forward to backward but the hidden states"},
    )
    offload_residual_grad: bool = field(
        default=False,
        metadata={"help": "keep the residual stream's gradient on the offload target between tiled layer replays "
                          "(and the recomputing tiled loss), one tile on the device at a time, not the whole "
                          "[s, b, h] beside each layer's gathered K/V; needs --longctx-recompute-tiles > 1 and an "
                          "offload policy"},
    )
    tiled_output_over_input: bool = field(
        default=False,
        metadata={"help": "a layer replayed in tiles writes its output over its input's memory once the checkpoint "
                          "offload holds the input (an in-place residual: the input tensor then holds the output, so "
                          "nothing may keep intermediate hidden states); needs --longctx-recompute-tiles > 1 and "
                          "--longctx-offload-policy checkpoint"},
    )
    lean_norm: bool = field(
        default=False,
        metadata={"help": "RMSNorm keeps only its input and 1/rms for backward, as fused norms do "
                          "(for torch's nn.RMSNorm of Megatron's local spec; TE and apex norms already do)"},
    )

    def __post_init__(self) -> None:
        for name in ("offload_modules", "recompute_modules"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = tuple(v for v in value.replace(",", " ").split() if v)
                object.__setattr__(self, name, value)
            elif isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        _check_choices(self)
        self._check_numbers()
        self._check_combinations()

    def _check_numbers(self) -> None:
        for name in ("offload_num_layers", "offload_min_bytes", "offload_host_pool_bytes", "recompute_num_layers",
                     "recompute_tiles", "tiled_mlp_tiles", "tiled_loss_tiles"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise flag_error(name, f"got {value!r}; give an integer >= 0")
        for name in ("lean_norm", "tiled_loss_recompute", "offload_residual_grad", "tiled_output_over_input"):
            if not isinstance(getattr(self, name), bool):
                raise flag_error(name, f"got {getattr(self, name)!r}; give true or false")
        if not isinstance(self.offload_max_inflight, int) or self.offload_max_inflight < 1:
            raise flag_error("offload_max_inflight", f"got {self.offload_max_inflight!r}; give an integer >= 1")

    def _check_combinations(self) -> None:
        if self.offload_policy == "checkpoint" and self.recompute_granularity != "full":
            raise flag_error("offload_policy", "'checkpoint' offloads the checkpointed layer inputs of full "
                                               "recompute; also set --recompute-granularity full, or use policy "
                                               "'modules'/'layers'")
        if self.recompute_tiles > 1 and self.recompute_granularity != "full":
            raise flag_error("recompute_tiles", "replays layers of full recompute in tiles; also set "
                                                "--recompute-granularity full, or set it to 0")
        if self.tiled_loss_recompute and self.tiled_loss_tiles <= 1:
            raise flag_error("tiled_loss_recompute", "changes how the tiled loss runs; also set "
                                                     "--longctx-tiled-loss-tiles > 1, or drop it")
        if self.offload_residual_grad and (self.recompute_tiles <= 1 or not self.offload_enabled):
            raise flag_error("offload_residual_grad", "streams the gradient between layers replayed in tiles to the "
                                                      "offload target; also set --longctx-recompute-tiles > 1 and "
                                                      "--longctx-offload-policy checkpoint, or drop it")
        if self.tiled_output_over_input and (self.recompute_tiles <= 1 or self.offload_policy != "checkpoint"):
            raise flag_error("tiled_output_over_input", "writes a tiled layer's output over its input once the "
                                                        "checkpoint offload holds the input; also set "
                                                        "--longctx-recompute-tiles > 1 and --longctx-offload-policy "
                                                        "checkpoint, or drop it")
        if self.offload_policy == "modules" and not self.offload_modules:
            raise flag_error("offload_modules", "offload_policy=modules needs at least one module name")
        if self.recompute_granularity == "selective" and not self.recompute_modules:
            raise flag_error("recompute_modules", "selective recompute needs at least one module name")
        if self.offload_policy == "modules" and self.recompute_granularity == "full":
            raise flag_error("offload_policy", "under full recompute a layer saves only its input; "
                                               "use --longctx-offload-policy checkpoint instead of 'modules'")

    @property
    def offload_enabled(self) -> bool:
        return self.offload_policy != "none"

    @property
    def recompute_enabled(self) -> bool:
        return self.recompute_granularity != "none"

    @property
    def any_enabled(self) -> bool:
        return (self.offload_enabled or self.recompute_enabled or self.tiled_mlp_tiles > 1
                or self.tiled_loss_tiles > 1 or self.lean_norm)


@dataclasses.dataclass(frozen=True)
class ModelStateConfig:
    """Model states off the device: each layer's weights streamed into device slots for its use, its main
    gradients accumulated off the device (on the host pool, sharing --longctx-offload-host-pool-bytes with
    the activations, or in files under --longctx-offload-disk-dir)."""

    model_state_offload: Literal["none", "host", "disk"] = field(
        default="none", metadata={"help": "where weights and main gradients live between uses: none (on the device) | "
                                          "host (pinned host pool) | disk (files, staged through the host pool)"}
    )
    model_state_slots: int = field(
        default=2, metadata={"help": "device slots for streamed weights (and for gradients), each sized for the "
                                     "largest layer; at least 2 (one in use, one being filled)"}
    )

    distributed_optimizer: bool = field(
        default=False, metadata={"help": "Megatron's distributed optimizer with the offload: the off-device "
                                         "optimizer's states sharded over the data x context parallel ranks, each "
                                         "rank's updated range all-gathered into every rank's weights after the step"}
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        if isinstance(self.model_state_slots, bool) or not isinstance(self.model_state_slots, int) \
                or self.model_state_slots < 2:
            raise flag_error("model_state_slots", f"got {self.model_state_slots!r}; give an integer >= 2")
        if not isinstance(self.distributed_optimizer, bool):
            raise flag_error("distributed_optimizer", f"got {self.distributed_optimizer!r}; give True or False")

    @property
    def enabled(self) -> bool:
        return self.model_state_offload != "none"


# The feature dataclasses whose fields become --longctx-* flags, with the LongContextConfig attribute.
FEATURES: tuple[tuple[str, type], ...] = (("cp", ContextParallelConfig), ("memory", MemoryConfig),
                                            ("model_states", ModelStateConfig))


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
    model_states: ModelStateConfig = field(default_factory=ModelStateConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.model_states, ModelStateConfig):
            raise TypeError("LongContextConfig.model_states must be a ModelStateConfig, got "
                            f"{type(self.model_states).__name__}")
        if self.memory.offload_disk_dir is not None and self.memory.offload_target != "disk" \
                and self.model_states.model_state_offload != "disk":
            raise flag_error("offload_disk_dir", "is only used with --longctx-offload-target disk or "
                                                 "--longctx-model-state-offload disk")
        if not isinstance(self.cp, ContextParallelConfig):
            raise TypeError(f"LongContextConfig.cp must be a ContextParallelConfig, got {type(self.cp).__name__}")
        if not isinstance(self.memory, MemoryConfig):
            raise TypeError(f"LongContextConfig.memory must be a MemoryConfig, got {type(self.memory).__name__}")
        if (self.cp.cp_ulysses_size and self.cp.cp_algorithm != "auto"
                and algorithms.get(self.cp.cp_algorithm).heads != "groups"):
            raise flag_error("cp_ulysses_size", f"only applies to the hybrid algorithm, but --longctx-cp-algorithm is "
                                                f"{self.cp.cp_algorithm!r}; drop it or choose hybrid")

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> LongContextConfig:
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
