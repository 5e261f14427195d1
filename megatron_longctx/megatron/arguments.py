"""The ``--longctx-*`` command-line flags, generated from the config dataclasses, and back.

:func:`add_longctx_args` is an ``extra_args_provider`` for Megatron-LM: 0.16's scripts pass it to
``pretrain(..., extra_args_provider=...)``, 0.19's to ``parse_and_validate_args(extra_args_provider=...)``.
Every field of every dataclass in :data:`megatron_longctx.config.FEATURES` becomes one flag
``--longctx-<field-with-dashes>`` (dest ``longctx_<field>``) with the field's default and help; no
flag is written by hand; a ``Literal[...]`` field's values are the flag's ``choices``.  Fields a Megatron
flag already covers (:data:`megatron_longctx.config.MEGATRON_FLAGS`, the ``recompute_*``) are read from
Megatron's arguments instead (:func:`plugin_recompute`).
:func:`config_from_args` turns the parsed namespace into a validated
:class:`~megatron_longctx.config.LongContextConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from typing import Any, Optional, Sequence

from megatron_longctx import cp_algorithms as algorithms
from megatron_longctx.config import (
    FEATURES,
    MEGATRON_FLAGS,
    LongContextConfig,
    choices,
    flag_name,
)
from megatron_longctx.megatron.script_setup import has_transformer_engine

DEST_PREFIX = "longctx_"
GROUP_TITLE = "megatron-longctx"


def _kind(annotation: Any) -> str:
    """bool | int | float | seq | str, from a field's resolved annotation (``X | None`` counts as ``X``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    origin = typing.get_origin(annotation) or annotation
    if origin in (tuple, list):
        return "seq"
    return {bool: "bool", int: "int", float: "float"}.get(origin, "str")


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field, annotation: Any,
               allowed: tuple | None) -> None:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    help_text = f.metadata.get("help", f.name) + f" (default: {default!r})"
    kwargs: dict[str, Any] = dict(dest=DEST_PREFIX + f.name, default=default, help=help_text)
    kind = _kind(annotation)
    if kind == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction
    elif kind == "seq":
        kwargs.update(nargs="*", type=str, metavar="NAME")
    elif kind in ("int", "float"):
        kwargs["type"] = int if kind == "int" else float
    else:
        kwargs["type"] = str
    if allowed is not None:  # a Literal[...] field: argparse rejects any other value, listing these
        kwargs["choices"] = allowed
    group.add_argument(flag_name(f.name), **kwargs)


def add_longctx_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one ``--longctx-<field>`` flag per config field to ``parser``; return it (``extra_args_provider``)."""
    if flag_name(dataclasses.fields(FEATURES[0][1])[0].name) in parser._option_string_actions:
        return parser  # already added (e.g. by the launcher and again as extra_args_provider)
    group = parser.add_argument_group(title=GROUP_TITLE)
    for _, cls in FEATURES:
        hints, allowed = typing.get_type_hints(cls), choices(cls)
        for f in dataclasses.fields(cls):
            if f.name not in MEGATRON_FLAGS:  # read from Megatron's own flag instead
                _add_field(group, f, hints[f.name], allowed.get(f.name))
    return parser


def escape_help_percents(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Double the ``%`` of help strings argparse cannot format (Megatron 0.19 generates one: ``--help``
    crashes), leaving ``%(default)s``-style fields alone; return ``parser``."""
    for action in parser._actions:
        if not isinstance(action.help, str) or "%" not in action.help:
            continue
        try:
            action.help % dict(vars(action), prog=parser.prog)
        except (ValueError, TypeError, KeyError):
            action.help = re.sub(r"%(?!\()", "%%", action.help.replace("%%", "%"))
    return parser


def megatron_parser() -> argparse.ArgumentParser:
    """Megatron-LM's argument parser (``megatron.training``) with the ``--longctx-*`` group; ``--help`` works."""
    from megatron.training.arguments import add_megatron_arguments

    add_megatron_arguments = getattr(add_megatron_arguments, "__longctx_wrapped__", add_megatron_arguments)
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser = add_longctx_args(add_megatron_arguments(parser))
    return escape_help_percents(parser)


def given_dests(argv: Sequence[str], parser: argparse.ArgumentParser) -> set[str]:
    """Destinations that ``argv`` sets explicitly (``--flag value``, ``--flag=value``, ``--no-flag``)."""
    dests = set()
    for token in argv:
        if token.startswith("--"):
            action = parser._option_string_actions.get(token.split("=", 1)[0])
            if action is not None:
                dests.add(action.dest)
    return dests


def with_defaults(argv: Sequence[str], defaults: Sequence[Sequence[str]],
                  parser: Optional[argparse.ArgumentParser] = None) -> tuple[list[str], list[str]]:
    """``(argv + each default whose destination argv does not set, the defaults added as text)``.

    ``defaults``: flag tokens, e.g. ``("--distributed-backend", "gloo")``; a flag this Megatron does not
    know is skipped.  ``parser``: Megatron's (default :func:`megatron_parser`)."""
    parser = megatron_parser() if parser is None else parser
    given = given_dests(argv, parser)
    out, added = list(argv), []
    for tokens in defaults:
        action = parser._option_string_actions.get(tokens[0])
        if action is None or action.dest in given:
            continue
        out += list(tokens)
        given.add(action.dest)
        added.append(" ".join(tokens))
    return out, added


def config_from_args(args: argparse.Namespace) -> LongContextConfig:
    """The validated config of a namespace parsed with :func:`add_longctx_args` (``ValueError`` names the flag)."""
    values: dict[str, Any] = {}
    for _, cls in FEATURES:
        for f in dataclasses.fields(cls):
            if f.name in MEGATRON_FLAGS:
                continue
            dest = DEST_PREFIX + f.name
            if not hasattr(args, dest):
                raise ValueError(f"{flag_name(f.name)} is missing from the parsed arguments: pass "
                                 "megatron_longctx.add_longctx_args as extra_args_provider")
            value = getattr(args, dest)
            if isinstance(value, list):
                value = tuple(item for v in value for item in v.replace(",", " ").split())
            values[f.name] = value
    values.update(plugin_recompute(args, values.get("offload_policy", "none"), values.get("recompute_tiles", 0)))
    values.update(plugin_distributed_optimizer(args, values.get("model_state_offload", "none")))
    return LongContextConfig.from_flat(values)


def plugin_distributed_optimizer(args: argparse.Namespace, model_state_offload: str) -> dict[str, Any]:
    """``ModelStateConfig.distributed_optimizer``: Megatron's ``--use-distributed-optimizer`` given with
    ``--longctx-model-state-offload``, whose streamer replaces the buffers Megatron's distributed optimizer
    shards.  The plugin then shards its off-device optimizer's states itself, and Megatron builds its DDP and
    its optimizer without the flag (:func:`take_distributed_optimizer`).  ``{}``: not taken."""
    if model_state_offload == "none":
        return {}
    # Megatron's flag, or the mark take_distributed_optimizer leaves where it cleared it
    if getattr(args, "use_distributed_optimizer", False) or getattr(args, "longctx_took_distributed_optimizer", False):
        return {"distributed_optimizer": True}
    return {}


def add_longctx_args_taking_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """:func:`add_longctx_args`, with a parse that hands the plugin the Megatron flags it runs itself
    (:func:`take_distributed_optimizer`) before Megatron validates them: the ``extra_args_provider`` of a rank
    whose command line was checked before it started (``megatron-longctx run``'s workers)."""
    parser = add_longctx_args(parser)
    parse_known_args = parser.parse_known_args

    def parse_and_take(*a: Any, **kw: Any) -> Any:  # parse_args goes through here too
        namespace, rest = parse_known_args(*a, **kw)
        take_distributed_optimizer(namespace, config_from_args(namespace))
        return namespace, rest

    parser.parse_known_args = parse_and_take  # type: ignore[method-assign]
    return parser


def take_distributed_optimizer(args: argparse.Namespace, cfg: LongContextConfig) -> None:
    """Clear Megatron's ``--use-distributed-optimizer`` where the plugin runs it
    (:func:`plugin_distributed_optimizer`), before Megatron validates and uses its arguments: its DDP,
    optimizer and checkpoints are then the non-distributed ones, over which the off-device optimizer shards its
    states."""
    if cfg.model_states.distributed_optimizer and getattr(args, "use_distributed_optimizer", False):
        args.use_distributed_optimizer = False
        args.longctx_took_distributed_optimizer = True


# Megatron's selective-recompute modules whose own implementation fails without Transformer Engine:
# "layernorm" (every CheckpointWithoutOutput path needs TE's FP8GlobalStateManager) and "mlp" with a bias
# (the MLP returns its bias Parameter out of an autograd Function: backward recurses).
def _megatron_cannot(args: argparse.Namespace, modules: tuple) -> list[str]:
    if getattr(args, "transformer_impl", "local") == "transformer_engine" and has_transformer_engine():
        return []
    failing = ["layernorm"] if "layernorm" in modules else []
    if "mlp" in modules and getattr(args, "add_bias_linear", True):
        failing.append("mlp")
    return failing


def plugin_recompute(args: argparse.Namespace, offload_policy: str, recompute_tiles: int = 0) -> dict[str, Any]:
    """The ``MemoryConfig.recompute_*`` values: the part of Megatron's ``--recompute-*`` the plugin runs.

    Megatron runs its own recompute, except where it cannot here: selective ``layernorm`` / ``mlp`` with a
    bias without Transformer Engine (:func:`_megatron_cannot`), full recompute whose checkpointed
    inputs ``--longctx-offload-policy checkpoint`` offloads, and full recompute replayed in sequence tiles
    (``--longctx-recompute-tiles``).  Then the plugin runs all of it (same
    modules, same layers) and the model is built with Megatron's recompute off.  ``{}``: Megatron's own.
    """
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is None and getattr(args, "recompute_activations", False):
        granularity = "selective"  # Megatron's --recompute-activations (validate_args maps it later)
    if granularity not in ("full", "selective"):
        return {}
    modules = tuple(getattr(args, "recompute_modules", None) or ("core_attn",))
    if granularity == "full" and offload_policy != "checkpoint" and recompute_tiles <= 1:
        return {}
    if granularity == "selective":
        failing = _megatron_cannot(args, modules)
        if not failing:
            return {}
        from megatron_longctx.config import RECOMPUTE_MODULE_NAMES

        others = [m for m in modules if m not in RECOMPUTE_MODULE_NAMES]
        if others:
            raise ValueError(f"--recompute-modules: Megatron cannot recompute {', '.join(failing)} without "
                             f"Transformer Engine and megatron-longctx, which runs them instead, has no recompute "
                             f"for {', '.join(others)}; install Transformer Engine (--transformer-impl "
                             "transformer_engine) or recompute those modules separately")
        return dict(recompute_granularity="selective", recompute_modules=modules)
    return dict(recompute_granularity="full", recompute_method=getattr(args, "recompute_method", None) or "uniform",
                recompute_num_layers=int(getattr(args, "recompute_num_layers", None) or 0))


def _check_kernel_backend(name: Optional[str]) -> None:
    """``--longctx-cp-kernel-backend`` names a backend that exists and runs on this machine's device."""
    if name is None:
        return
    import torch

    from megatron_longctx.kernels.select import BACKENDS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    usable = [n for n, b in BACKENDS.items() if b.available(device) is None]
    flag = flag_name("cp_kernel_backend")
    if name not in BACKENDS:
        raise ValueError(f"{flag}: unknown backend {name!r}; choose auto or one of {', '.join(sorted(BACKENDS))} "
                         f"(usable here: {', '.join(usable)})")
    reason = BACKENDS[name].available(device)
    if reason is not None:
        raise ValueError(f"{flag}: {name!r} cannot run on this machine ({reason}); choose auto or one of "
                         f"{', '.join(usable)}")


def check_after_parsing(args: argparse.Namespace) -> LongContextConfig:
    """Validate the ``--longctx-*`` values and their combination with Megatron's flags, right after parsing
    (before ``torch.distributed`` starts); ``ValueError`` names the flag and the fix.  Returns the config."""
    cfg = config_from_args(args)
    _check_kernel_backend(cfg.cp.backend)
    cp_size = getattr(args, "context_parallel_size", 1) or 1
    dropout = getattr(args, "attention_dropout", 0.0) or 0.0
    if cp_size > 1 and dropout > 0:
        raise ValueError(f"--attention-dropout: {dropout} is not supported with context parallelism "
                         f"(--context-parallel-size {cp_size}) by megatron-longctx's attention; "
                         "set --attention-dropout 0")
    if cfg.memory.recompute_tiles > 1:
        _check_recompute_tiles(args, cfg, cp_size)
    check_window(getattr(args, "window_size", None), getattr(args, "seq_length", None))
    if cfg.model_states.enabled:
        _check_model_states(args, cfg)
        take_distributed_optimizer(args, cfg)
    return cfg


def _check_model_states(args: argparse.Namespace, cfg: LongContextConfig) -> None:
    """Model-state offload against Megatron's flags, its disk directory and the host pool's bound."""
    from types import SimpleNamespace

    from megatron_longctx.memory import model_state_checks as model_states
    from megatron_longctx.memory.offload_disk import default_root

    model_states.check_megatron_offload(vars(args))
    model_states.check_ddp_overlap(vars(args))
    if cfg.model_states.model_state_offload == "disk":
        model_states.check_disk_step(vars(args))
        model_states.check_disk_dir(default_root(SimpleNamespace(offload_disk_dir=cfg.memory.offload_disk_dir,
                                                                  offload_run_dir=getattr(args, "save", None))))
    hidden = getattr(args, "hidden_size", None)
    if hidden:
        heads = getattr(args, "num_attention_heads", None) or 1
        groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else heads
        gated = bool(getattr(args, "swiglu", False))
        ffn = getattr(args, "ffn_hidden_size", None) or 4 * hidden
        bf16 = getattr(args, "bf16", False) or getattr(args, "fp16", False)
        model_states.check_pool_holds_slots(cfg.memory.offload_host_pool_bytes,
                                            model_states.layer_params(hidden, ffn, heads, groups or heads, gated),
                                            2 if bf16 else 4)


def check_window(window: Any, seq_length: Optional[int]) -> None:
    """Megatron's ``--window-size LEFT,RIGHT`` against a causal GPT of ``seq_length`` tokens (``None``: no
    window); ``ValueError`` names the flag and the fix."""
    if window is None:
        return
    if isinstance(window, str):
        try:
            window = tuple(int(x) for x in window.split(","))
        except ValueError:
            window = ()
    if len(window) != 2:
        raise ValueError(f"--window-size {window}: give LEFT,RIGHT in tokens, e.g. --window-size 4096,0")
    left, right = window
    given = f"--window-size {left},{right}"
    if left < -1 or right < -1:
        raise ValueError(f"{given}: each side is a number of tokens (>= 0) or -1 for unbounded; e.g. "
                         f"--window-size {max(left, 0) or 4096},0")
    if right > 0:
        raise ValueError(f"{given}: the model's attention is causal, so no token sees a later one; give the right "
                         f"side 0 (--window-size {left},0)")
    if seq_length and left >= seq_length:
        raise ValueError(f"{given}: the left side covers the whole --seq-length {seq_length}, which is plain causal "
                         f"attention; drop --window-size, or give a left side below {seq_length}")


def _check_recompute_tiles(args: argparse.Namespace, cfg: LongContextConfig, cp_size: int) -> None:
    """The layer replay in sequence tiles gathers K/V over CP, and cannot replay dropout per tile."""
    flag = flag_name("recompute_tiles")
    for name in ("hidden_dropout", "attention_dropout"):
        if getattr(args, name, 0.0):
            raise ValueError(f"{flag}: --{name.replace('_', '-')} {getattr(args, name)} would draw other masks per "
                             f"tile; set it to 0, or set {flag} 0")
    if cp_size <= 1:
        return
    algorithm = cfg.cp.cp_algorithm
    if algorithm == "auto":
        comm = getattr(args, "cp_comm_type", None) or "p2p"
        comms = comm if isinstance(comm, (list, tuple)) else [comm]
        gathers = all(getattr(algorithms.BY_CP_COMM_TYPE.get(c), "gathers_kv", False) for c in comms)
        algorithm = comm  # named as the user gave it
    else:
        gathers = algorithms.get(algorithm).gathers_kv
    if not gathers:
        raise ValueError(f"{flag}: a layer replayed in tiles gathers K/V once over the CP group (all-gather), "
                         f"but the CP algorithm is {algorithm!r}; add --cp-comm-type all_gather (or "
                         f"--longctx-cp-algorithm allgather), or set {flag} 0")
