"""MemoryConfig validation and the wiring's argument checks: every bad value names its flag and the fix."""

import pytest

from megatron_longctx.memory import MemoryConfig


def test_defaults_enable_nothing():
    cfg = MemoryConfig()
    assert not cfg.any_enabled and not cfg.offload_enabled and not cfg.recompute_enabled


@pytest.mark.parametrize("kwargs, flag", [
    (dict(offload_policy="everything"), "--longctx-offload-policy"),
    (dict(offload_target="nvme"), "--longctx-offload-target"),
    (dict(recompute_granularity="half"), "--recompute-granularity"),
    (dict(recompute_method="random"), "--recompute-method"),
    (dict(recompute_granularity="selective", recompute_modules=("attention",)), "--recompute-modules"),
    (dict(offload_policy="modules", offload_modules=("everything",)), "--longctx-offload-modules"),
    (dict(tiled_mlp_tiles=-1), "--longctx-tiled-mlp-tiles"),
    (dict(tiled_loss_tiles=2.5), "--longctx-tiled-loss-tiles"),
    (dict(offload_max_inflight=0), "--longctx-offload-max-inflight"),
    (dict(offload_host_pool_bytes=-1), "--longctx-offload-host-pool-bytes"),
    # combinations that cannot work
    (dict(offload_policy="checkpoint"), "--longctx-offload-policy"),
    (dict(offload_policy="checkpoint", recompute_granularity="selective"), "--longctx-offload-policy"),
    (dict(offload_policy="modules", recompute_granularity="full"), "--longctx-offload-policy"),
    (dict(offload_policy="modules", offload_modules=()), "--longctx-offload-modules"),
    (dict(recompute_granularity="selective", recompute_modules=""), "--recompute-modules"),
])
def test_bad_values_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        MemoryConfig(**kwargs)


def test_module_lists_parse_from_flag_strings():
    cfg = MemoryConfig(recompute_granularity="selective", recompute_modules="core_attn, mlp")
    assert cfg.recompute_modules == ("core_attn", "mlp")
    cfg = MemoryConfig(offload_policy="modules", offload_modules=["mlp"])
    assert cfg.offload_modules == ("mlp",)


def test_every_field_has_help():
    import dataclasses

    for f in dataclasses.fields(MemoryConfig):
        assert f.metadata.get("help"), f.name


def test_wiring_rejects_what_it_cannot_do():
    import torch
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_longctx.megatron.memory_spec import apply_memory_to_layer_spec, install
    from megatron_longctx.memory.tiled_loss import TiledLossArgs, tiled_logits_loss
    from megatron_longctx.megatron.tiled_mlp import tiled_mlp_spec

    with pytest.raises(ValueError, match="MemoryConfig"):
        install(torch.nn.Linear(2, 2), {"tiled_mlp_tiles": 2})
    with pytest.raises(ValueError, match="MemoryConfig"):
        apply_memory_to_layer_spec(None, {"tiled_mlp_tiles": 2})
    with pytest.raises(ValueError, match="--longctx-tiled-mlp-tiles"):
        tiled_mlp_spec(ModuleSpec(module=torch.nn.Linear), 2)
    with pytest.raises(ValueError, match="--longctx-tiled-mlp-tiles"):
        apply_memory_to_layer_spec(ModuleSpec(module=torch.nn.Linear), MemoryConfig(tiled_mlp_tiles=2))
    with pytest.raises(ValueError, match="--longctx-tiled-loss-tiles"):
        TiledLossArgs(0)
    with pytest.raises(ValueError, match="--longctx-tiled-loss-recompute"):
        TiledLossArgs(2, norm=torch.nn.LayerNorm(2))
    with pytest.raises(ValueError, match=r"\[b, s\]"):
        tiled_logits_loss(torch.zeros(4, 1, 2), torch.zeros(3, 2), torch.zeros(4, 1, dtype=torch.long),
                          TiledLossArgs(2))
    from megatron_longctx.memory.offload import ActivationOffloader

    with pytest.raises(ValueError, match="--longctx-offload-policy"):
        ActivationOffloader(MemoryConfig())
