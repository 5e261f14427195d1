"""The ``--longctx-*`` command-line flags, generated from the config dataclasses, and back.

:func:`add_longctx_args` is an ``extra_args_provider`` for Megatron-LM: 0.16's scripts pass it to
``pretrain(..., extra_args_provider=...)``, 0.19's to ``parse_and_validate_args(extra_args_provider=...)``.
Every field of every dataclass in :data:`megatron_longctx.config.FEATURES` becomes one flag
``--longctx-<field-with-dashes>`` (dest ``longctx_<field>``) with the field's default and help; no
flag is written by hand.  :func:`config_from_args` turns the parsed namespace into a validated
:class:`~megatron_longctx.config.LongContextConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from megatron_longctx.config import FEATURES, LongContextConfig, flag_name

DEST_PREFIX = "longctx_"
GROUP_TITLE = "megatron-longctx"


def _kind(f: dataclasses.Field) -> str:
    """bool | int | float | seq | str, from the field's annotation (a string under postponed annotations)."""
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for kind, words in (("bool", ("bool",)), ("seq", ("tuple", "list", "Sequence")), ("int", ("int",)),
                        ("float", ("float",))):
        if any(w in annotation for w in words):
            return kind
    return "str"


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field) -> None:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    help_text = f.metadata.get("help", f.name) + f" (default: {default!r})"
    kwargs: dict[str, Any] = dict(dest=DEST_PREFIX + f.name, default=default, help=help_text)
    kind = _kind(f)
    if kind == "bool":
        kwargs["action"] = argparse.BooleanOptionalAction
    elif kind == "seq":
        kwargs.update(nargs="*", type=str, metavar="NAME")
    elif kind in ("int", "float"):
        kwargs["type"] = int if kind == "int" else float
    else:
        kwargs["type"] = str
    group.add_argument(flag_name(f.name), **kwargs)


def add_longctx_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add one ``--longctx-<field>`` flag per config field to ``parser``; return it (``extra_args_provider``)."""
    if flag_name(dataclasses.fields(FEATURES[0][1])[0].name) in parser._option_string_actions:
        return parser  # already added (e.g. by the launcher and again as extra_args_provider)
    group = parser.add_argument_group(title=GROUP_TITLE)
    for _, cls in FEATURES:
        for f in dataclasses.fields(cls):
            _add_field(group, f)
    return parser


def config_from_args(args: argparse.Namespace) -> LongContextConfig:
    """The validated config of a namespace parsed with :func:`add_longctx_args` (``ValueError`` names the flag)."""
    values: dict[str, Any] = {}
    for _, cls in FEATURES:
        for f in dataclasses.fields(cls):
            dest = DEST_PREFIX + f.name
            if not hasattr(args, dest):
                raise ValueError(f"{flag_name(f.name)} is missing from the parsed arguments: pass "
                                 "megatron_longctx.add_longctx_args as extra_args_provider")
            value = getattr(args, dest)
            if isinstance(value, list):
                value = tuple(item for v in value for item in v.replace(",", " ").split())
            values[f.name] = value
    return LongContextConfig.from_flat(values)
