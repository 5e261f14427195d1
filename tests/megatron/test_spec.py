"""apply_to_spec replaces every dense self-attention core_attention, on every kind of Megatron spec."""

import dataclasses
import functools
import importlib

import pytest
import torch

from megatron_longctx import apply_to_spec
from megatron_longctx.config import ContextParallelConfig, LongContextConfig
from megatron_longctx.megatron.core_attention import ContextParallelAttention
from megatron_longctx.megatron.spec import count_context_parallel_attention
from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import WORLD, tiny_config


def _core_attentions(spec):
    """Every (owner type name, core_attention entry) in a spec tree."""
    found, seen = [], set()

    def walk(obj):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x)
        elif isinstance(obj, functools.partial):
            walk(list(obj.args) + list(obj.keywords.values()))
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                value = getattr(obj, f.name, None)
                if f.name == "core_attention":
                    found.append((type(obj).__name__, value))
                elif f.name != "params":
                    walk(value)

    walk(spec)
    return found


def _is_ours(entry):
    return getattr(entry, "module", None) is ContextParallelAttention


def _check(spec, expected_replaced, **options):
    before = repr(spec)
    out = apply_to_spec(spec, **options)
    assert repr(spec) == before, "apply_to_spec mutated its input"
    assert not any(_is_ours(e) for _, e in _core_attentions(spec))
    assert count_context_parallel_attention(out) == expected_replaced
    assert count_context_parallel_attention(apply_to_spec(out, **options)) == expected_replaced  # idempotent
    return out


def _local():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec


def test_local_layer_spec():
    out = _check(_local()(), 1, cp_algorithm="ring", cp_kernel_backend="reference")
    entry = out.submodules.self_attention.submodules.core_attention
    assert entry.params["cp_config"] == ContextParallelConfig(cp_algorithm="ring", cp_kernel_backend="reference")


def test_local_mla_spec():
    out = _check(_local()(multi_latent_attention=True), 1)
    assert type(out.submodules.self_attention.submodules).__name__ == "MLASelfAttentionSubmodules"


def test_local_moe_spec():
    _check(_local()(num_experts=4), 1)


def test_te_structured_spec():
    """The TE layer spec's structure (TE is not installed here: the TE classes are stand-ins)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    te = {name: type(name, (torch.nn.Module,), {}) for name in (
        "TELayerNormColumnParallelLinear", "TEDotProductAttention", "TERowParallelLinear")}
    spec = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(
                                      linear_qkv=te["TELayerNormColumnParallelLinear"],
                                      core_attention=te["TEDotProductAttention"],
                                      linear_proj=te["TERowParallelLinear"], q_layernorm=IdentityOp,
                                      k_layernorm=IdentityOp)),
        self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=IdentityOp,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=te["TELayerNormColumnParallelLinear"],
                                                            linear_fc2=te["TERowParallelLinear"])),
        mlp_bda=get_bias_dropout_add))
    out = _check(spec, 1)
    assert out.submodules.self_attention.submodules.linear_qkv is te["TELayerNormColumnParallelLinear"]


def _import_or_skip(module: str, absent: tuple[str, ...] = ()):
    """Import ``module``; skip only when it (or a parent package) is missing from this Megatron-Core, or
    when the module it lacks is one of the optional packages named in ``absent``.  Any other import
    failure is a failure."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module == missing or module.startswith(missing + ".") or missing.split(".")[0] in absent:
            pytest.skip(f"{module}: {missing} is not installed")
        raise


def test_te_spec():
    pytest.importorskip("transformer_engine")
    from megatron.core.models.gpt import gpt_layer_specs

    _check(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(), 1)


def test_cross_attention_is_left_alone():
    from megatron.core.transformer.attention import CrossAttention, CrossAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer = _local()()
    cross = ModuleSpec(module=CrossAttention, submodules=CrossAttentionSubmodules(
        linear_q=torch.nn.Linear, linear_kv=torch.nn.Linear, core_attention=DotProductAttention,
        linear_proj=torch.nn.Linear))
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, cross_attention=cross))
    out = _check(layer, 1)
    assert out.submodules.cross_attention.submodules.core_attention is DotProductAttention


def test_hybrid_stack_spec():
    hybrid = _import_or_skip("megatron.core.models.hybrid.hybrid_layer_specs")
    spec = hybrid.hybrid_stack_spec
    out = _check(spec, 2)  # attention_layer and mla_layer; the DSA layer's sparse attention is kept
    dsa = out.submodules.dsa_layer.submodules.self_attention.submodules.core_attention
    assert dsa == spec.submodules.dsa_layer.submodules.self_attention.submodules.core_attention
    assert dsa.module.__name__ == "DSAttention"
    assert _is_ours(out.submodules.attention_layer.submodules.self_attention.submodules.core_attention)


def test_mamba_stack_spec():
    mamba = _import_or_skip("megatron.core.models.mamba.mamba_layer_specs", ("mamba_ssm", "causal_conv1d", "triton"))
    _check(mamba.mamba_stack_spec, count_attention(mamba.mamba_stack_spec))


def count_attention(spec):
    return sum(1 for owner, e in _core_attentions(spec)
               if owner != "CrossAttentionSubmodules" and getattr(e, "submodules", None) is None)


MODELOPT_GPT = "megatron.core.post_training.modelopt.gpt.model_specs"


def _modelopt_gpt_spec(local_core_attention: bool):
    from megatron.core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec

    with megatron_parallel():
        _check(get_gpt_modelopt_spec(tiny_config(), local_core_attention=local_core_attention), 1)
    return True


def test_modelopt_gpt_spec():
    _import_or_skip(MODELOPT_GPT, ("modelopt",))
    assert run_ranks(WORLD, _modelopt_gpt_spec, True) == [True] * WORLD


def test_modelopt_gpt_te_spec():
    _import_or_skip(MODELOPT_GPT, ("modelopt",))
    pytest.importorskip("transformer_engine")
    assert run_ranks(WORLD, _modelopt_gpt_spec, False) == [True] * WORLD


def test_modelopt_hybrid_spec():
    specs = _import_or_skip("megatron.core.post_training.modelopt.hybrid.model_specs", ("modelopt",))
    spec = specs.get_hybrid_stack_modelopt_spec(local_core_attention=True)
    _check(spec, count_attention(spec))


def test_options_and_errors():
    with pytest.raises(ValueError, match="--longctx-cp-algorithm"):
        apply_to_spec(_local()(), cp_algorithm="zigzag")
    with pytest.raises(ValueError, match="unknown megatron-longctx option"):
        apply_to_spec(_local()(), cp_algoritm="ring")
    with pytest.raises(ValueError, match="no self-attention"):
        apply_to_spec([torch.nn.Linear])
    with pytest.raises(ValueError, match="either config= or keyword options"):
        apply_to_spec(_local()(), config=LongContextConfig(), cp_algorithm="ring")
    out = apply_to_spec(_local()(), config=LongContextConfig(cp=ContextParallelConfig(cp_algorithm="allgather")))
    assert out.submodules.self_attention.submodules.core_attention.params["cp_config"].cp_algorithm == "allgather"


def test_memory_options_pass_through(monkeypatch):
    from megatron_longctx.megatron.features.tiled_mlp import TiledMLPFeature

    calls = []

    def fake_apply(self, spec, cfg):
        calls.append(cfg.memory)
        return spec

    monkeypatch.setattr(TiledMLPFeature, "spec", fake_apply)
    out = apply_to_spec(_local()(), tiled_mlp_tiles=4, cp_algorithm="ring")
    assert len(calls) == 1 and calls[0].tiled_mlp_tiles == 4
    assert count_context_parallel_attention(out) == 1
    apply_to_spec(_local()())
    assert len(calls) == 1, "no memory option given: the memory transform must not run"


def _moe_block_model():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from megatron_longctx.megatron import cpu_compat
    from tests.gpt_kit import build_gpt

    with cpu_compat.enabled(), megatron_parallel(cp=2):
        cfg = tiny_config(1, 2, num_moe_experts=2, moe_layer_freq=[1, 0], moe_router_topk=1,
                          moe_router_pre_softmax=True)
        block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
        assert type(block).__name__ == "TransformerBlockSubmodules"
        out = _check(block, 2)
        assert len(out.layer_specs) == 2 and out.layer_specs[0] is not block.layer_specs[0]
        model = build_gpt(cfg, out)
        kinds = [type(layer.self_attention.core_attention) for layer in model.decoder.layers]
        assert kinds == [ContextParallelAttention] * 2, kinds


def test_moe_decoder_block_spec_builds_a_cp_model():
    run_ranks(WORLD, _moe_block_model)
