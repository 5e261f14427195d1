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
  features are configured, :meth:`LongContextPlugin.install` is applied to the built model (both through
  :meth:`megatron_longctx.megatron.plugin.LongContextPlugin.build`, which the main job's model provider uses too).

Users who prefer editing ``pretrain_gpt.py`` find the equivalent few-line diffs in ``patches/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import os
import sys
import threading
from typing import Any, Callable, Optional, Sequence

from megatron_longctx.config import LongContextConfig
from megatron_longctx.megatron.script_setup import (
    megatron_default_args,
    wrap_compile_helpers,
    wrap_training_log,
)
from megatron_longctx.patching import patch

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
    saved: list = dataclasses.field(default_factory=list)  # the patching.Patch objects of install()
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
    from megatron_longctx.megatron.arguments import config_from_args

    return config_from_args(args)


def _wrap_add_megatron_arguments(original: Callable) -> Callable:
    from megatron_longctx.megatron.arguments import add_longctx_args, check_after_parsing, escape_help_percents

    @functools.wraps(original)
    def add_megatron_arguments(parser, *args, **kwargs):
        parser = escape_help_percents(add_longctx_args(original(parser, *args, **kwargs)))
        parse_known_args = parser.parse_known_args

        def parse_known_and_check(*a, **kw):  # parse_args goes through here too
            namespace, rest = parse_known_args(*a, **kw)
            try:
                check_after_parsing(namespace)
            except ValueError as e:  # before torch.distributed starts: one line, the flag first
                print(f"megatron_longctx.launch: error: {e}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
            warn_if_mixed_trees()
            return namespace, rest

        parser.parse_known_args = parse_known_and_check
        return parser

    add_megatron_arguments.__longctx_wrapped__ = original
    return add_megatron_arguments


def _wrap_model_init(original: Callable, spec_param: str) -> Callable:
    from megatron_longctx.megatron.plugin import LongContextPlugin

    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)

        def build(config: Any, specs: dict[str, Any]) -> Any:
            bound.arguments.update({name: spec for name, spec in specs.items() if spec is not None})
            if "config" in bound.arguments:
                bound.arguments["config"] = config
            original(*bound.args, **bound.kwargs)
            return self

        specs = {name: bound.arguments.get(name) for name in (spec_param, "mtp_block_spec")}
        plugin = LongContextPlugin(current_config())
        plugin.build(build, bound.arguments.get("config"), specs, who="megatron_longctx.launch")

    __init__.__longctx_wrapped__ = original
    return __init__


def _targets() -> list[tuple[Any, str, Callable]]:
    """(owner, attribute, replacement) for every place :func:`install` wraps."""
    targets = []
    with contextlib.suppress(ImportError):
        datasets_utils = importlib.import_module("megatron.core.datasets.utils")
        if not hasattr(datasets_utils.compile_helpers, "__longctx_wrapped__"):
            targets.append((datasets_utils, "compile_helpers", wrap_compile_helpers(datasets_utils.compile_helpers)))
    with contextlib.suppress(ImportError):
        training = importlib.import_module("megatron.training.training")
        if not hasattr(training.training_log, "__longctx_wrapped__"):
            targets.append((training, "training_log", wrap_training_log(training.training_log)))
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
            _state.saved.append(patch(owner, name, replacement, "megatron_longctx.launch: the plugin in Megatron"))


def uninstall() -> None:
    """Undo :func:`install` (a no-op when not installed)."""
    with _lock:
        while _state.saved:
            _state.saved.pop().undo()
        _state.config = None


def is_installed() -> bool:
    return bool(_state.saved)


def megatron_trees() -> dict[str, list[str]]:
    """``{folder holding megatron/: [loaded megatron.* subpackages from it]}``."""
    trees: dict[str, list[str]] = {}
    for name, module in list(sys.modules.items()):
        if name.count(".") != 1 or not name.startswith("megatron.") or module is None:
            continue
        path = getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), None)
        if path:
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(path)))
                                   if path.endswith("__init__.py") else os.path.dirname(os.path.abspath(path)))
            trees.setdefault(root, []).append(name)
    return trees


_warned_trees: set = set()


def warn_if_mixed_trees() -> None:
    """Warn once when the loaded ``megatron.*`` packages come from more than one folder (``megatron`` is a
    namespace package: a checkout beside the script and an installed wheel can both contribute)."""
    trees = megatron_trees()
    key = tuple(sorted(trees))
    if len(trees) > 1 and key not in _warned_trees:
        _warned_trees.add(key)
        where = "; ".join(f"{', '.join(sorted(mods))} from {root}" for root, mods in sorted(trees.items()))
        print(f"megatron_longctx.launch: warning: Megatron is loaded from {len(trees)} trees ({where}); run from "
              "a folder with one Megatron tree (a Megatron-LM checkout, or none to use the installed "
              "megatron-core)", file=sys.stderr, flush=True)


def default_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(argv + the defaults the launcher sets, those defaults as text)``; flags given in ``argv`` win.

    * without CUDA, :func:`megatron_longctx.megatron.cpu_compat.cpu_default_args` (gloo, CUDA-only fusions off, ...);
    * ``--eval-interval 1000`` when this Megatron has no default for it (0.19: else ``train_iters // None``);
    * ``--no-create-attention-mask-in-dataloader``: a dense ``[s, s]`` mask per sample that our attention's
      causal layers do not read, at any CP size (64 GiB of float32 at 128K tokens, 4 TiB at 1M);
    * with ``--context-parallel-size`` > 1 (our attention serves CP): ``--attention-dropout 0`` (Megatron's
      default 0.1 is not supported under CP; an explicit value is checked after parsing).
    """
    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.megatron.arguments import megatron_parser, with_defaults

    try:
        parser = megatron_parser()
    except ImportError:  # no megatron.training (the 0.16 wheel without a Megatron-LM checkout): nothing to set
        return list(argv), []
    argv, added = cpu_compat.cpu_default_args(list(argv))
    defaults = megatron_default_args(parser)
    namespace, _ = parser.parse_known_args(argv)
    defaults.append(("--no-create-attention-mask-in-dataloader",))
    if getattr(namespace, "context_parallel_size", 1) > 1:
        defaults.append(("--attention-dropout", "0"))
    argv, more = with_defaults(argv, defaults, parser)
    return argv, added + more


USAGE = "usage: python -m megatron_longctx.launch <script.py> [Megatron-LM args] [--longctx-* args]"


def _print_help() -> None:
    print(USAGE)
    print("\nRuns a Megatron-LM training script unmodified with megatron-longctx installed. Without CUDA it "
          "enters megatron_longctx.megatron.cpu_compat and sets the CPU defaults (gloo, CUDA-only fusions off); "
          "flags given explicitly win. Megatron-LM's arguments, with the megatron-longctx group:\n")
    import argparse

    from megatron_longctx.megatron.arguments import add_longctx_args, megatron_parser

    try:
        parser = megatron_parser()
    except ImportError:  # megatron-core without megatron.training: our group alone
        parser = add_longctx_args(argparse.ArgumentParser(prog="megatron_longctx.launch", add_help=False))
    parser.prog = "megatron_longctx.launch <script.py>"
    parser.print_help()


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m megatron_longctx.launch <script.py> [args...]``: run ``script.py`` as ``__main__``.

    The folder of ``script.py`` goes first on ``sys.path`` before Megatron is imported (as ``python
    script.py`` would do), so a Megatron-LM checkout beside the script is the one Megatron tree used; from a
    folder without ``megatron/`` the installed megatron-core is (:func:`warn_if_mixed_trees` warns otherwise).
    """
    import runpy

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        _print_help()
        raise SystemExit(0 if argv else 2)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_longctx.launch: no such script: {argv[0]}")
    sys.path.insert(0, os.path.dirname(script))  # the script imports its neighbours (gpt_builders, ...)
    install()
    script_args = argv[1:]
    if not {"-h", "--help"} & set(script_args):
        script_args, added = default_args(script_args)
        if added and os.environ.get("RANK", "0") == "0":
            print(f"megatron_longctx.launch: defaults set (explicit flags win): {', '.join(added)}", flush=True)
    from megatron_longctx.megatron import cpu_compat

    cpu_compat.enable()  # a no-op with CUDA; undone when the process ends
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
