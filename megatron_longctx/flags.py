"""The ``--longctx-*`` naming rule shared by every feature config: a flag is its field's name."""

from __future__ import annotations


def flag_name(field_name: str) -> str:
    """The command-line flag of a config field: ``cp_algorithm`` -> ``--longctx-cp-algorithm``."""
    return "--longctx-" + field_name.replace("_", "-")


def flag_error(field_name: str, message: str) -> ValueError:
    """A ``ValueError`` that names the flag of ``field_name``, then says what is wrong and the fix."""
    return ValueError(f"{flag_name(field_name)}: {message}")
