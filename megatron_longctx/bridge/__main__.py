"""``python -m megatron_longctx.bridge --recipe pkg.mod:fn [dotted.key=value ...] [--longctx-* ...]``.

Bridge's recipe function builds the ``ConfigContainer``; an optional ``--config-file`` YAML and the
``dotted.key=value`` overrides are applied by Bridge's own helper (``process_config_with_overrides``,
Hydra syntax, as Bridge's ``run_recipe.py``); then :func:`megatron_longctx.bridge.configure` adds the
plugin with the ``--longctx-*`` flags given (the same flags as the Megatron-LM launcher), and Bridge's
``pretrain()`` trains with its GPT ``forward_step``.  ``--dry-run`` prints the configured model config
and stops.  On a machine without a GPU :mod:`megatron_longctx.megatron.cpu_compat` is on for the run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Any, Callable, Optional, Sequence

from megatron_longctx.megatron.arguments import DEST_PREFIX, add_longctx_args, given_dests


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_longctx.bridge", description=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True, metavar="PKG.MOD:FN",
                   help="the recipe function returning a ConfigContainer, e.g. "
                        "megatron.bridge.recipes.llama:llama3_8b_pretrain_config")
    p.add_argument("--config-file", default=None, help="a YAML file merged into the recipe's config first")
    p.add_argument("--dry-run", action="store_true", help="print the configured model config; do not train")
    p.add_argument("overrides", nargs="*", metavar="dotted.key=value", help="Bridge's (Hydra) overrides")
    return add_longctx_args(p)


def load_recipe(target: str) -> Callable[[], Any]:
    """The function ``pkg.mod:fn`` names; ``SystemExit`` naming the module path or the function."""
    module_path, sep, name = target.partition(":")
    if not sep or not module_path or not name:
        raise SystemExit(f"--recipe {target!r}: expected pkg.module:function")
    try:
        module = importlib.import_module(module_path)
    except ImportError as err:
        raise SystemExit(f"--recipe {target!r}: cannot import module {module_path!r} ({err})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SystemExit(f"--recipe {target!r}: module {module_path!r} has no function {name!r}")
    return fn


def longctx_options(args: argparse.Namespace, argv: Sequence[str], p: argparse.ArgumentParser) -> dict[str, Any]:
    """The ``--longctx-*`` flags given on the command line, as :func:`configure` keyword arguments."""
    options = {}
    for dest in sorted(given_dests(argv, p)):
        if dest.startswith(DEST_PREFIX):
            value = getattr(args, dest)
            if isinstance(value, list):  # "a,b c" -> ("a", "b", "c"), as the launcher reads them
                value = tuple(item for v in value for item in v.replace(",", " ").split())
            options[dest[len(DEST_PREFIX):]] = value
    return options


def bridge_missing() -> Optional[str]:
    """``None`` when Megatron-Bridge's training code imports here, else the one-line reason it does not."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.bridge") is None:
        return ("Megatron-Bridge is not installed in this environment: pip install megatron-bridge "
                "(see docs/bridge.md), or use the Megatron-LM launcher: python -m megatron_longctx.launch")
    import logging
    import warnings

    logging.disable(logging.CRITICAL)  # Bridge logs each optional import it misses, with its traceback
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("megatron.bridge.training.utils.omegaconf_utils")
            importlib.import_module("megatron.bridge.training.pretrain")
    except ImportError as err:
        if "transformer_engine" in f"{err} {err.name}":
            return ("Megatron-Bridge's training code imports Transformer Engine (transformer_engine.pytorch), "
                    "which is not installed here: install it on a CUDA machine (pip install "
                    "'transformer-engine[pytorch]', or megatron-longctx[gpu]); without it use the Megatron-LM "
                    "launcher: python -m megatron_longctx.launch")
        return f"Megatron-Bridge does not import here ({type(err).__name__}: {err})"
    finally:
        logging.disable(logging.NOTSET)
    return None


def build_config(argv: Sequence[str]) -> tuple[Any, argparse.Namespace]:
    """The recipe's ConfigContainer with the file, the overrides and megatron-longctx applied."""
    p = parser()
    args = p.parse_args(argv)  # --help answers before Bridge is imported
    reason = bridge_missing()
    if reason is not None:
        raise SystemExit(f"python -m megatron_longctx.bridge: {reason}")
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from megatron_longctx.bridge import configure

    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        p.error(f"overrides are dotted.key=value; got {' '.join(bad)}")
    cfg = load_recipe(args.recipe)()
    cfg = process_config_with_overrides(cfg, config_filepath=args.config_file, cli_overrides=list(args.overrides))
    try:
        return configure(cfg, **longctx_options(args, argv, p)), args
    except ValueError as err:
        raise SystemExit(str(err)) from None


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg, args = build_config(argv)
    spec = cfg.model.transformer_layer_spec
    if args.dry_run:
        print(f"megatron_longctx.bridge: {args.recipe}: model.transformer_layer_spec = {spec!r}")
        return
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain

    from megatron_longctx.megatron import cpu_compat

    with cpu_compat.enabled():
        pretrain(cfg, forward_step)


if __name__ == "__main__":
    main()
