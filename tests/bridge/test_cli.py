"""``python -m megatron_longctx.bridge``: Bridge's recipe, its dotted overrides, the ``--longctx-*`` flags."""

import pytest

from megatron_longctx.bridge.__main__ import load_recipe
from tests.bridge.bridge_kit import bridge_available, import_bridge

RECIPE = "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config"


def test_a_recipe_that_cannot_be_imported_names_the_module_path():
    with pytest.raises(SystemExit, match=r"cannot import module 'no_such_pkg\.recipes'"):
        load_recipe("no_such_pkg.recipes:llama_config")
    with pytest.raises(SystemExit, match=r"module 'json' has no function 'no_such_recipe'"):
        load_recipe("json:no_such_recipe")
    with pytest.raises(SystemExit, match="expected pkg.module:function"):
        load_recipe("json.loads")


@pytest.mark.skipif(bridge_available() is not None, reason=str(bridge_available()))
def test_overrides_and_longctx_flags_reach_the_config(capsys, tmp_path):
    import_bridge()
    from megatron_longctx.bridge import LongContextLayerSpec
    from megatron_longctx.bridge.__main__ import build_config, main

    cfg, _ = build_config(["--recipe", RECIPE, "model.num_layers=3", "model.context_parallel_size=2",
                           "model.attention_dropout=0.0", "train.train_iters=7", "--longctx-cp-algorithm", "allgather",
                           "--longctx-offload-modules", "core_attn,mlp", "--longctx-offload-policy", "modules"])
    assert (cfg.model.num_layers, cfg.model.context_parallel_size, cfg.train.train_iters) == (3, 2, 7)
    spec = cfg.model.transformer_layer_spec
    assert isinstance(spec, LongContextLayerSpec)
    assert spec.options == {"cp_algorithm": "allgather", "offload_modules": ("core_attn", "mlp"),
                            "offload_policy": "modules"}
    # run_config.yaml, as Bridge writes it at the start of training and reads it back on resume
    cfg.to_yaml(str(tmp_path / "run_config.yaml"))
    back = type(cfg).from_yaml(str(tmp_path / "run_config.yaml"))
    assert isinstance(back.model.transformer_layer_spec, LongContextLayerSpec)
    assert back.model.transformer_layer_spec.config() == spec.config()
    assert back.model.transformer_layer_spec.base is spec.base
    main(["--recipe", RECIPE, "--dry-run", "--longctx-tiled-mlp-tiles", "2"])
    assert "LongContextLayerSpec" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"model\.attention_backend='local'.*model\.attention_backend=auto"):
        build_config(["--recipe", RECIPE, "model.attention_backend=local"])
    with pytest.raises(SystemExit, match=r"model\.attention_dropout=0\.1.*set model\.attention_dropout=0\.0"):
        build_config(["--recipe", RECIPE, "model.context_parallel_size=2"])  # the recipe's dropout under CP
