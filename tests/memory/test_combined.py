"""Every memory feature at once, with context parallelism (CP=2, ContextParallelAttention) and TP=2.

The oracle is the same model without memory features under the same parallel layout and seeds.
"""

from megatron_longctx.memory import MemoryConfig
from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import ORACLE, assert_same, build_gpt, cp_batches, cpu, loss_and_grads

TOGETHER = [
    MemoryConfig(recompute_granularity="full", offload_policy="checkpoint", offload_target="disk", offload_min_bytes=0,
                 tiled_mlp_tiles=2, tiled_loss_tiles=3),
    MemoryConfig(recompute_granularity="selective", recompute_modules=("core_attn", "mlp", "layernorm"),
                 offload_policy="modules", offload_modules=("qkv", "proj"), offload_target="disk",
                 offload_min_bytes=0, tiled_mlp_tiles=2, tiled_loss_tiles=2),
]


def _cp2_all_features():
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_longctx import apply_to_spec
    from megatron_longctx.megatron.memory_spec import install

    with cpu(), megatron_parallel(cp=2):
        batches = cp_batches(parallel_state.get_context_parallel_group())
        common = dict(attention_dropout=0.0, context_parallel_size=2)
        plain = build_gpt(**ORACLE, spec=apply_to_spec(get_gpt_layer_local_spec()), **common)
        ref = loss_and_grads(plain, batches=batches)
        for cfg in TOGETHER:
            options = {"tiled_mlp_tiles": cfg.tiled_mlp_tiles}  # the spec-level part through apply_to_spec
            model = build_gpt(**ORACLE, spec=apply_to_spec(get_gpt_layer_local_spec(), **options), **common)
            handle = install(model, cfg)
            got = loss_and_grads(model, batches=batches)
            # Megatron's cross-entropy runs in float32, the tiled loss in the model's float64
            assert_same(ref, got, rtol=1e-5, atol=1e-7)
            assert handle.offloader.stats.offloaded_bytes > 0
            handle.remove()


def test_all_features_with_context_parallel_2():
    run_ranks(2, _cp2_all_features)


def _tp2_all_features():
    from megatron_longctx.megatron.memory_spec import install

    with cpu(), megatron_parallel(tp=2):
        ref = loss_and_grads(build_gpt(**ORACLE), steps=2)
        for cfg in TOGETHER:
            model = build_gpt(**ORACLE)
            handle = install(model, cfg)
            assert_same(ref, loss_and_grads(model, steps=2), rtol=1e-5, atol=1e-7)
            handle.remove()


def test_all_features_with_tensor_parallel_2():
    run_ranks(2, _tp2_all_features)
