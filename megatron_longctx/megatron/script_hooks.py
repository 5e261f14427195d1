"""Small helpers that the ``patches/`` diffs call from Megatron-LM's own training scripts.

Each is the script-side counterpart of what :mod:`megatron_longctx.megatron.launch` installs, for users
who edit ``pretrain_gpt.py`` (and, in the 0.16 layout, ``gpt_builders.py``) instead of using the launcher.
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any, Callable, Optional

from megatron_longctx.config import LongContextConfig
from megatron_longctx.megatron.arguments import add_longctx_args_taking_flags
from megatron_longctx.megatron.script_setup import skip_built_helpers

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def extra_args_provider(other: Optional[ArgsProvider] = None) -> ArgsProvider:
    """An ``extra_args_provider`` that adds the ``--longctx-*`` flags after ``other``'s (e.g. ModelOpt's).

    Its parse hands the plugin the Megatron flags it runs itself, as the launcher's does
    (:func:`~megatron_longctx.megatron.arguments.add_longctx_args_taking_flags`).  Like the launcher, it also
    skips Megatron's start-up build of the dataset helpers when the compiled ``helpers_cpp`` imports (the
    megatron-core wheel ships it without the Makefile)."""
    skip_built_helpers()

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if other is not None:
            parser = other(parser)
        return add_longctx_args_taking_flags(parser)

    return provider


def longctx_layer_spec(base: Any, config: LongContextConfig) -> Callable[..., Any]:
    """Megatron-LM 0.19 ``GPTModelConfig.transformer_layer_spec`` value: ``base`` (a spec, a spec callable,
    or ``None`` for Megatron's default choice) transformed by :func:`megatron_longctx.apply_to_spec`."""
    from megatron_longctx.megatron.plugin import LongContextPlugin

    def transformer_layer_spec(model_config: Any, vp_stage: Optional[int] = None) -> Any:
        if base is None:
            from megatron.training.models.gpt import default_layer_spec

            spec = default_layer_spec(model_config, vp_stage)
        elif callable(base) and not hasattr(base, "submodules"):
            takes_vp = "vp_stage" in inspect.signature(base).parameters
            spec = base(model_config, vp_stage=vp_stage) if takes_vp else base(model_config)
        else:
            spec = base
        return LongContextPlugin(config).spec(spec, require=True)

    return transformer_layer_spec
