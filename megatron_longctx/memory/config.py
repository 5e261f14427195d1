"""Typed configuration of the activation-memory features: offload, recompute, tiled MLP, tiled loss.

One frozen dataclass, flat field names (each field is the ``--longctx-<field-with-dashes>`` flag of the
same name, except the ``recompute_*`` fields: Megatron's own ``--recompute-*`` flags fill them with the
part of Megatron's recompute that the plugin runs, see :func:`megatron_longctx.megatron.args.config_from_args`).  ``__post_init__`` validates each field and the combinations that cannot work, and every
error names the flag and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Optional

from megatron_longctx.flags import flag_error as _err

OFFLOAD_POLICIES = ("none", "checkpoint", "modules", "layers")
OFFLOAD_TARGETS = ("host", "disk")
RECOMPUTE_GRANULARITIES = ("none", "full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
# Names a Megatron user gives to the parts of a transformer layer (selective recompute, module offload).
RECOMPUTE_MODULE_NAMES = ("core_attn", "qkv", "proj", "mlp", "layernorm")
OFFLOAD_MODULE_NAMES = ("core_attn", "qkv", "proj", "mlp", "layernorm")


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """Activation-memory features of megatron-longctx (ALST, arXiv:2506.13996; MsT, arXiv:2407.15892)."""

    offload_policy: str = field(
        default="none",
        metadata={"help": "activation offload: none | checkpoint (layer inputs under full recompute) | "
                          "modules (named modules' saved tensors) | layers (all saved tensors of the first N layers)"},
    )
    offload_target: str = field(
        default="host", metadata={"help": "where offloaded activations go: host (pinned memory pool) | disk (files)"}
    )
    offload_modules: tuple = field(
        default=("core_attn", "mlp"),
        metadata={"help": "modules whose saved tensors are offloaded under offload_policy=modules "
                          "(core_attn, qkv, proj, mlp, layernorm)"},
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
    offload_disk_dir: Optional[str] = field(
        default=None, metadata={"help": "directory for offload_target=disk (default: a fresh temporary directory)"}
    )
    offload_max_inflight: int = field(
        default=4, metadata={"help": "most asynchronous offload copies / file writes in flight at once"}
    )
    offload_prefetch: bool = field(
        default=True, metadata={"help": "during backward, fetch the next layer's tensors while this layer runs"}
    )
    recompute_granularity: str = field(
        default="none", metadata={"help": "activation recompute run by the plugin: none | full (whole layers) | "
                                          "selective (named modules); from Megatron's --recompute-granularity"}
    )
    recompute_method: str = field(
        default="uniform", metadata={"help": "full recompute: uniform (every layer) | block (first N layers); "
                                             "from Megatron's --recompute-method"}
    )
    recompute_num_layers: int = field(
        default=0, metadata={"help": "full recompute with method=block: how many layers (0 = all layers); "
                                     "from Megatron's --recompute-num-layers"}
    )
    recompute_modules: tuple = field(
        default=("core_attn",),
        metadata={"help": "selective recompute: modules to recompute (core_attn, qkv, proj, mlp, layernorm); "
                          "from Megatron's --recompute-modules"},
    )
    tiled_mlp_tiles: int = field(
        default=0, metadata={"help": "run each MLP over this many sequence tiles (0 or 1 = off)"}
    )
    tiled_loss_tiles: int = field(
        default=0,
        metadata={"help": "compute output logits and cross-entropy over this many sequence tiles (0 or 1 = off)"},
    )

    def __post_init__(self) -> None:
        for name in ("offload_modules", "recompute_modules"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = tuple(v for v in value.replace(",", " ").split() if v)
                object.__setattr__(self, name, value)
            elif isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        self._check_choices()
        self._check_numbers()
        self._check_combinations()

    def _check_choices(self) -> None:
        choices = {
            "offload_policy": OFFLOAD_POLICIES,
            "offload_target": OFFLOAD_TARGETS,
            "recompute_granularity": RECOMPUTE_GRANULARITIES,
            "recompute_method": RECOMPUTE_METHODS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise _err(name, f"got {getattr(self, name)!r}; choose one of {', '.join(allowed)}")
        for name, allowed in (("offload_modules", OFFLOAD_MODULE_NAMES), ("recompute_modules", RECOMPUTE_MODULE_NAMES)):
            unknown = [m for m in getattr(self, name) if m not in allowed]
            if unknown:
                raise _err(name, f"unknown module(s) {unknown}; choose from {', '.join(allowed)}")

    def _check_numbers(self) -> None:
        for name in ("offload_num_layers", "offload_min_bytes", "offload_host_pool_bytes", "recompute_num_layers",
                     "tiled_mlp_tiles", "tiled_loss_tiles"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _err(name, f"got {value!r}; give an integer >= 0")
        if not isinstance(self.offload_max_inflight, int) or self.offload_max_inflight < 1:
            raise _err("offload_max_inflight", f"got {self.offload_max_inflight!r}; give an integer >= 1")

    def _check_combinations(self) -> None:
        if self.offload_policy == "checkpoint" and self.recompute_granularity != "full":
            raise _err("offload_policy", "'checkpoint' offloads the checkpointed layer inputs of full recompute; "
                                         "also set --recompute-granularity full, or use policy 'modules'/'layers'")
        if self.offload_policy == "modules" and not self.offload_modules:
            raise _err("offload_modules", "offload_policy=modules needs at least one module name")
        if self.recompute_granularity == "selective" and not self.recompute_modules:
            raise _err("recompute_modules", "selective recompute needs at least one module name")
        if self.offload_policy == "modules" and self.recompute_granularity == "full":
            raise _err("offload_policy", "under full recompute a layer saves only its input; "
                                         "use --longctx-offload-policy checkpoint instead of 'modules'")
        if self.offload_disk_dir is not None and self.offload_target != "disk":
            raise _err("offload_disk_dir", "is only used with --longctx-offload-target disk")

    @property
    def offload_enabled(self) -> bool:
        return self.offload_policy != "none"

    @property
    def recompute_enabled(self) -> bool:
        return self.recompute_granularity != "none"

    @property
    def any_enabled(self) -> bool:
        return (self.offload_enabled or self.recompute_enabled or self.tiled_mlp_tiles > 1
                or self.tiled_loss_tiles > 1)
