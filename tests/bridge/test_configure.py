"""megatron_longctx.bridge without Bridge: the spec object and the refusals on megatron-core's own
``GPTModelConfig`` (the same ``transformer_layer_spec`` field and the same in-place ``core_attention``
overwrite under ``attention_backend=local`` as Bridge's GPT provider)."""

import json

import pytest

from megatron_longctx.bridge import LongContextLayerSpec, LongContextModelHook, configure
from megatron_longctx.bridge.spec import TARGET, allow_in_run_config
from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import SEQ, VOCAB, WORLD, assert_same, build_gpt, cpu, loss_and_grads, tiny_config


def _gpt_model_config(**fields):
    gpt = pytest.importorskip("megatron.training.models.gpt", reason="needs megatron.training (megatron-core >= 0.19)")
    fields.setdefault("transformer_impl", "local")  # no Transformer Engine here: the local layer spec
    return gpt.GPTModelConfig(transformer=tiny_config(**fields), vocab_size=VOCAB, seq_length=SEQ,
                              position_embedding_type="rope")


def test_spec_object_is_plain_importable_data():
    """What run_config.yaml holds: an importable ``_target_`` and plain values, instantiated back equal."""
    pytest.importorskip("megatron.training.config.container", reason="needs megatron.training (megatron-core >= 0.19)")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.config.container import ConfigContainerBase
    from megatron.training.config.instantiate_utils import instantiate

    spec = LongContextLayerSpec(base=get_gpt_layer_local_spec,
                                options={"cp_algorithm": "ring", "offload_modules": ("core_attn", "mlp")})
    as_dict = ConfigContainerBase._convert_value_to_dict(spec)
    assert as_dict["_target_"] == TARGET == "megatron_longctx.bridge.spec.LongContextLayerSpec"
    json.dumps(as_dict["options"])  # plain values only
    pytest.importorskip("omegaconf", reason="loading run_config.yaml back needs omegaconf (installed with Bridge)")
    allow_in_run_config()  # what configure() does: Megatron's loader takes only megatron.* targets unless told
    back = instantiate(as_dict)
    assert isinstance(back, LongContextLayerSpec) and back.base is get_gpt_layer_local_spec
    assert back.config() == spec.config()  # lists from YAML become the config's tuples again
    # wrapping twice keeps one layer around the recipe's spec, the later options winning
    again = LongContextLayerSpec(base=spec, options={"cp_algorithm": "allgather"})
    assert again.base is get_gpt_layer_local_spec and again.config().cp.cp_algorithm == "allgather"
    with pytest.raises(ValueError, match="--longctx-offload-policy"):
        LongContextLayerSpec(options={"offload_policy": "everything"})


@pytest.mark.parametrize("fields, options, match", [
    ({"cp": 2, "attention_backend": "local"}, {}, r"model\.attention_backend='local'.*attention_backend=auto"),
    ({"cp": 2, "attention_dropout": 0.1}, {}, r"model\.attention_dropout=0\.1.*model\.attention_dropout=0\.0"),
    ({"cpu_offloading": True}, {"offload_policy": "modules"}, r"model\.cpu_offloading=True.*=false"),
    ({"fine_grained_activation_offloading": True, "offload_modules": ["core_attn"]}, {"offload_policy": "layers"},
     r"model\.fine_grained_activation_offloading=True"),
    ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
     {"recompute_granularity": "selective"},
     r"model\.recompute_granularity='full'.*model\.recompute_granularity=null"),
    ({}, {"offload_policy": "checkpoint"}, r"--longctx-offload-policy.*--recompute-granularity full"),
    ({}, {"cp_kernel_backend": "no-such-kernel"}, r"--longctx-cp-kernel-backend: unknown backend"),
    ({}, {"tiles": 4}, r"unknown megatron-longctx option\(s\) \['tiles'\]"),
])
def test_refusals_name_the_field_and_the_fix(fields, options, match):
    if fields.get("attention_backend"):
        from megatron.core.transformer.enums import AttnBackend

        fields["attention_backend"] = AttnBackend[fields["attention_backend"]]
    model_config = _gpt_model_config(**fields)
    before = model_config.transformer_layer_spec
    with pytest.raises(ValueError, match=match):
        configure(model_config, **options)
    assert model_config.transformer_layer_spec is before and not model_config.pre_wrap_hooks  # nothing half-done


def test_configure_moves_megatrons_recompute_into_the_plugin_once():
    """Full recompute whose layer inputs the checkpoint offload moves runs in the plugin (the launcher's rule):
    the model config's own recompute is cleared; configuring again (a config loaded back) keeps one hook."""
    model_config = _gpt_model_config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    configure(model_config, offload_policy="checkpoint")
    spec = model_config.transformer_layer_spec
    assert spec.options == {"offload_policy": "checkpoint", "recompute_granularity": "full",
                            "recompute_method": "uniform", "recompute_num_layers": 1}
    assert model_config.recompute_granularity is None
    configure(model_config, tiled_loss_tiles=2)
    assert model_config.transformer_layer_spec.options == {**spec.options, "tiled_loss_tiles": 2}
    assert [type(h) for h in model_config.pre_wrap_hooks] == [LongContextModelHook]


def _build_through_builder(attention_backend: str, cp: int) -> list:
    """Rank body: megatron-core's GPTModelBuilder builds a model from a configured GPTModelConfig
    and runs its pre-wrap hooks; returns what each layer's core_attention is, or the hook's refusal."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnBackend
    from megatron.training.models.base import compose_hooks
    from megatron.training.models.gpt import GPTModelBuilder

    with megatron_parallel(cp=cp), cpu():
        model_config = _gpt_model_config(cp=cp)
        configure(model_config, tiled_mlp_tiles=2, tiled_loss_tiles=2)
        model_config.attention_backend = AttnBackend[attention_backend]  # set after configure: only the hook sees it
        model = [GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())]
        try:
            model = compose_hooks(model_config.pre_wrap_hooks)(model)
        except RuntimeError as err:
            return [str(err)]
        layers = model[0].decoder.layers
        if cp == 1:  # the configured model (tiled MLP and loss on) against plain Megatron with its weights
            plain = build_gpt(_gpt_model_config().transformer)
            plain.load_state_dict(model[0].state_dict(), strict=True)
            assert_same(loss_and_grads(plain), loss_and_grads(model[0]), rtol=1e-5, atol=1e-6)
        return [(type(layer.self_attention.core_attention).__name__, type(layer.mlp).__name__) for layer in layers]


def test_built_model_holds_our_attention_and_the_hook_catches_the_in_place_overwrite():
    pytest.importorskip("megatron.training.models.gpt", reason="needs megatron.training (megatron-core >= 0.19)")
    for got in run_ranks(WORLD, _build_through_builder, "auto", 2):
        assert got == [("ContextParallelAttention", "TiledMLP")] * 2
    for got in run_ranks(WORLD, _build_through_builder, "auto", 1):  # and the same loss and grads as Megatron's
        assert got == [("ContextParallelAttention", "TiledMLP")] * 2
    for got in run_ranks(WORLD, _build_through_builder, "local", 1):  # CP=2 asserts in the build
        assert len(got) == 1 and "runs DotProductAttention as core_attention" in got[0]
        assert "model.attention_backend" in got[0]


def test_hybrid_stack_spec_gets_our_attention_and_keeps_the_options():
    """A hybrid model (megatron-core's HybridModelConfig, Bridge's HybridModelProvider field): its
    ``hybrid_stack_spec`` becomes a copy with our attention in every dense attention layer."""
    hybrid = pytest.importorskip("megatron.training.models.hybrid", reason="needs megatron.training (megatron-core >= 0.19)")
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.transformer.enums import AttnBackend

    from megatron_longctx.megatron.spec import count_context_parallel_attention

    model_config = hybrid.HybridModelConfig(transformer=tiny_config(), vocab_size=VOCAB, seq_length=SEQ,
                                            hybrid_layer_pattern="*-*-")
    configure(model_config, cp_algorithm="allgather", tiled_loss_tiles=2)
    got = model_config.hybrid_stack_spec
    assert count_context_parallel_attention(hybrid_stack_spec) == 0
    assert count_context_parallel_attention(got) == 2  # the attention and MLA layers (DSA has its own indexer)
    attention = got.submodules.attention_layer.submodules.self_attention.submodules.core_attention
    assert attention.params["cp_config"].cp_algorithm == "allgather"
    configure(model_config, tiled_mlp_tiles=2)  # again: the options add up, one hook
    assert [h.options for h in model_config.pre_wrap_hooks] == [{"cp_algorithm": "allgather", "tiled_loss_tiles": 2,
                                                                 "tiled_mlp_tiles": 2}]
    assert count_context_parallel_attention(model_config.hybrid_stack_spec) == 2
    model_config.attention_backend = AttnBackend.local
    with pytest.raises(ValueError, match=r"model\.attention_backend='local'"):
        configure(model_config)
