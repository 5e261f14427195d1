"""megatron-longctx for Megatron-Bridge (NVIDIA's ``megatron.bridge``, NeMo's recipes): one call.

::

    from megatron.bridge.recipes.llama import llama3_8b_pretrain_config
    from megatron_longctx.bridge import configure

    cfg = configure(llama3_8b_pretrain_config(), cp_algorithm="ring", tiled_loss_tiles=8)
    pretrain(cfg, forward_step)

or from the command line, with Bridge's own ``dotted.key=value`` overrides::

    python -m megatron_longctx.bridge --recipe megatron.bridge.recipes.llama:llama3_8b_pretrain_config \\
        model.context_parallel_size=8 model.attention_dropout=0.0 --longctx-tiled-loss-tiles 8

Importing this package needs neither Bridge nor Megatron (:mod:`.configure`, :mod:`.spec`); the model
is built by Bridge's own builder from the spec object that :func:`configure` puts in the model config.
"""

from megatron_longctx.bridge.configure import (  # noqa: F401 - public names
    LongContextModelHook,
    check_built_model,
    check_model_config,
    configure,
)
from megatron_longctx.bridge.spec import LongContextLayerSpec  # noqa: F401

__all__ = ["LongContextLayerSpec", "LongContextModelHook", "check_built_model", "check_model_config", "configure"]
