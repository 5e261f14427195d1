"""Run an unmodified Megatron-LM training script with megatron-longctx installed.

``python -m megatron_longctx.launch pretrain_gpt.py <Megatron args> <--longctx-* args>``

:func:`install` is the one place where Megatron itself is wrapped (idempotent, version-checked,
reversible with :func:`uninstall`):

* ``megatron.training.arguments.add_megatron_arguments`` gains the ``--longctx-*`` flags, so
  ``parse_args`` accepts them whichever way the script calls it (0.16: inside ``pretrain``;
  0.19: ``parse_and_validate_args``);
* the model classes (``GPTModel``; ``HybridModel`` / ``MambaModel`` where present) transform the layer
  or stack spec they are given with :func:`megatron_longctx.apply_to_spec` before building.  Hooking the
  constructor rather than each spec getter catches every way a script picks its spec: the
  ``get_gpt_*_spec`` getters imported by name into ``gpt_builders.py`` (0.16) or
  ``megatron.training.models.gpt`` (0.19), ``--spec MODULE NAME``, the ModelOpt specs, and the in-place
  ``--attention-backend local`` override that 0.19 applies right before ``GPTModel(...)``.  When memory
  features are configured, :func:`megatron_longctx.memory.install` is applied to the built model.

Users who prefer editing ``pretrain_gpt.py`` find the equivalent few-line diffs in ``patches/``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import runpy
import sys
import threading
from typing import Any, Callable, Optional, Sequence

from megatron_longctx.config import LongContextConfig

# Megatron-Core minor versions the install step has been checked against.
SUPPORTED_MEGATRON = ((0, 16), (0, 17), (0, 18), (0, 19))
# Opt-in for untested versions (at the user's risk).
ALLOW_UNTESTED_ENV = "LONGCTX_ALLOW_UNTESTED_MEGATRON"

# (module, class, name of the spec parameter): the spec is the parameter right after ``config``.
_MODEL_CLASSES = (
    ("megatron.core.models.gpt.gpt_model", "GPTModel", "transformer_layer_spec"),
    ("megatron.core.models.hybrid.hybrid_model", "HybridModel", "hybrid_stack_spec"),
    ("megatron.core.models.mamba.mamba_model", "MambaModel", "mamba_stack_spec"),
)


@dataclasses.dataclass
class _State:
    saved: list = dataclasses.field(default_factory=list)  # (owner, attribute, original)
    config: Optional[LongContextConfig] = None


_state = _State()
_lock = threading.Lock()


def megatron_version() -> tuple[int, int]:
    from megatron.core.package_info import __version__

    major, minor = __version__.split(".")[:2]
    return int(major), int(minor)


def check_version() -> None:
    """Raise ``RuntimeError`` for a Megatron-Core version the install step was not checked against."""
    version = megatron_version()
    if version not in SUPPORTED_MEGATRON and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        supported = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_MEGATRON)
        raise RuntimeError(f"megatron-longctx supports Megatron-Core {supported}; found "
                           f"{version[0]}.{version[1]}. Install a supported megatron-core, or set "
                           f"{ALLOW_UNTESTED_ENV}=1 to try anyway.")


def current_config() -> LongContextConfig:
    """The config given to :func:`install`, else the one parsed from Megatron's global args."""
    if _state.config is not None:
        return _state.config
    try:
        from megatron.training.global_vars import get_args

        args = get_args()
    except (ImportError, AssertionError):
        return LongContextConfig()
    if args is None or not hasattr(args, "longctx_cp_algorithm"):
        return LongContextConfig()
    from megatron_longctx.megatron.args import config_from_args

    return config_from_args(args)


def _wrap_add_megatron_arguments(original: Callable) -> Callable:
    from megatron_longctx.megatron.args import add_longctx_args

    @functools.wraps(original)
    def add_megatron_arguments(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        return add_longctx_args(parser)

    add_megatron_arguments.__longctx_wrapped__ = original
    return add_megatron_arguments


def _wrap_model_init(original: Callable, spec_param: str) -> Callable:
    from megatron_longctx.megatron.spec import transform_spec

    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        cfg = current_config()
        spec = bound.arguments.get(spec_param)
        if spec is not None:
            bound.arguments[spec_param] = transform_spec(spec, cfg, require=False)
        mtp = bound.arguments.get("mtp_block_spec")
        if mtp is not None:
            bound.arguments["mtp_block_spec"] = transform_spec(mtp, cfg, require=False)
        original(*bound.args, **bound.kwargs)
        if cfg.memory.any_enabled:
            from megatron_longctx.memory import install as install_memory

            self._longctx_memory_handle = install_memory(self, cfg.memory)

    __init__.__longctx_wrapped__ = original
    return __init__


def _targets() -> list[tuple[Any, str, Callable]]:
    """(owner, attribute, replacement) for every place :func:`install` wraps."""
    targets = []
    try:
        arguments = importlib.import_module("megatron.training.arguments")
    except ImportError:
        arguments = None  # Megatron-Core without megatron.training: only the model hooks apply
    if arguments is not None:
        targets.append((arguments, "add_megatron_arguments",
                        _wrap_add_megatron_arguments(arguments.add_megatron_arguments)))
    for module_name, class_name, spec_param in _MODEL_CLASSES:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # not in this Megatron version, or needs optional packages (mamba_ssm, triton)
        targets.append((cls, "__init__", _wrap_model_init(cls.__init__, spec_param)))
    return targets


def install(config: Optional[LongContextConfig] = None) -> None:
    """Install the plugin into Megatron (idempotent).  ``config``: fixed options; default: parsed flags."""
    with _lock:
        _state.config = config
        if _state.saved:
            return
        check_version()
        for owner, name, replacement in _targets():
            _state.saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, replacement)


def uninstall() -> None:
    """Undo :func:`install` (a no-op when not installed)."""
    with _lock:
        while _state.saved:
            owner, name, original = _state.saved.pop()
            setattr(owner, name, original)
        _state.config = None


def is_installed() -> bool:
    return bool(_state.saved)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m megatron_longctx.launch <script.py> [args...]``: run ``script.py`` as ``__main__``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[2])
        raise SystemExit(0 if argv else 2)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_longctx.launch: no such script: {argv[0]}")
    install()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))  # the script imports its neighbours (gpt_builders, ...)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
