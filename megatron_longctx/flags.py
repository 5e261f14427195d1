"""The ``--longctx-*`` naming rule shared by every feature config: a flag is its field's name.

Fields whose job a Megatron flag already does are not flags of ours: :data:`MEGATRON_FLAGS` names the
Megatron flag each is read from (``config_from_args``), and errors about them name that flag.
"""

from __future__ import annotations

# Config field -> the Megatron-LM flag it is read from (no --longctx-* flag for these).
MEGATRON_FLAGS = {
    "recompute_granularity": "--recompute-granularity",
    "recompute_method": "--recompute-method",
    "recompute_num_layers": "--recompute-num-layers",
    "recompute_modules": "--recompute-modules",
}


def flag_name(field_name: str) -> str:
    """The command-line flag of a config field: ``cp_algorithm`` -> ``--longctx-cp-algorithm``
    (``recompute_granularity`` -> Megatron's ``--recompute-granularity``)."""
    return MEGATRON_FLAGS.get(field_name) or "--longctx-" + field_name.replace("_", "-")


def flag_error(field_name: str, message: str) -> ValueError:
    """A ``ValueError`` that names the flag of ``field_name``, then says what is wrong and the fix."""
    return ValueError(f"{flag_name(field_name)}: {message}")
