"""A tiny Megatron GPTModel with ContextParallelAttention under CP=2/4 matches Megatron's own CP=1 model.

Every case builds Megatron's local-spec GPT (DotProductAttention) at CP=1 as the reference, copies its
weights into a model built from the transformed spec at CP>1, feeds each rank its share of the same
global batch (Megatron's ``get_batch_on_this_cp_rank``), and compares the loss (summed over CP ranks)
and every parameter's gradient (summed over CP ranks, as DDP's dp_cp reduction does).
"""

import pytest
import torch

from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import WORLD, build_gpt, local_spec, loss_and_grads, tiny_config
from tests.gpt_kit import batch as global_batch

# (tp, cp, cp_comm_type, --longctx-cp-algorithm, mla, hierarchical sizes, extra config)
CASES = [
    (1, 2, "p2p", "auto", False, None, {}),
    (1, 2, "all_gather", "auto", False, None, {}),
    (1, 2, "a2a", "auto", False, None, {}),
    (1, 4, "p2p", "auto", False, None, {}),
    (1, 4, "all_gather", "auto", False, None, {}),
    (1, 4, "a2a", "auto", False, None, {}),
    (1, 4, "p2p", "hybrid", False, None, {}),  # option override; all-to-all size from --longctx-cp-ulysses-size
    (2, 2, "p2p", "auto", False, None, {}),
    (2, 2, "a2a", "auto", False, None, {}),
    (1, 2, "a2a", "ring", False, None, {}),  # option overrides --cp-comm-type
    (1, 2, "p2p", "auto", True, None, {}),  # MLA under ring
    (1, 2, "p2p", "auto", False, None, {"window_size": (5, 0)}),  # sliding window under ring
]


def _run_case(case, batch):
    from megatron.core import parallel_state

    from megatron_longctx import apply_to_spec
    from megatron_longctx.megatron.batch import get_batch_on_this_cp_rank

    tp, cp, comm, algorithm, mla, hcp, extra = case
    with megatron_parallel(tp=tp, cp=1):
        # Megatron's local DotProductAttention has no MLA head dims and builds its window mask on "cuda":
        # there the reference is our CP=1 path (no communication; checked against Megatron in
        # test_cp1_matches_megatron and against float64 math, MLA dims and windows included, in
        # test_core_attention).
        base_spec = apply_to_spec(local_spec(mla)) if (mla or extra) else local_spec(mla)
        base = build_gpt(tiny_config(tp, 1, mla, **extra), base_spec)
        ref_loss, ref_grads = loss_and_grads(base, batch)
        state = base.state_dict()
    kwargs = {"hierarchical_context_parallel_sizes": hcp} if hcp else {}
    options = {"cp_algorithm": algorithm}
    if algorithm == "hybrid":
        options["cp_ulysses_size"] = 2
    with megatron_parallel(tp=tp, cp=cp, **kwargs):
        cfg = tiny_config(tp, cp, mla, cp_comm_type=comm, **kwargs, **extra)
        model = build_gpt(cfg, apply_to_spec(local_spec(mla), **options), seed=99)
        model.load_state_dict(state)
        cp_group = parallel_state.get_context_parallel_group()
        local = get_batch_on_this_cp_rank(batch, cp_group)
        assert local["tokens"].shape[1] == batch["tokens"].shape[1] // cp
        loss, grads = loss_and_grads(model, local, cp_group, total_tokens=batch["loss_mask"].sum())
        expected = {"auto": {"p2p": "ring", "all_gather": "allgather", "a2a": "ulysses", "a2a+p2p": "hybrid"}[comm]}
        attn = model.decoder.layers[0].self_attention.core_attention
        assert attn.settings.algorithm == expected.get(algorithm, algorithm), (case, attn.settings)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{case}: loss {m}")
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert ref.abs().sum() > 0, f"{case}: {name} got no gradient in the reference"
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=2e-6, msg=lambda m: f"{case} {name}: {m}")


def _all_cases(cases):
    from megatron_longctx.megatron import cpu_compat

    batch = global_batch()
    with cpu_compat.enabled():
        for case in cases:
            _run_case(case, batch)


def _mla_buildable() -> bool:
    """Megatron-Core 0.16.1 without Transformer Engine cannot build MLA (isinstance against a TE stand-in)."""
    from megatron.core.transformer import multi_latent_attention

    te_linear = getattr(multi_latent_attention, "TELinear", None)
    return not multi_latent_attention.HAVE_TE or isinstance(te_linear, type)


def _case_id(case) -> str:
    tp, cp, comm, algorithm, mla, hcp, extra = case
    parts = [f"tp{tp}", f"cp{cp}", comm] + ([algorithm] if algorithm != "auto" else [])
    parts += (["mla"] if mla else []) + [f"{k}{v[0]}" if isinstance(v, tuple) else f"{k}{v}" for k, v in extra.items()]
    return "-".join(parts)


@pytest.mark.parametrize("case", [c for c in CASES if not c[4]], ids=_case_id)
def test_cp_matches_megatron_cp1(case):
    run_ranks(WORLD, _all_cases, [case])


@pytest.mark.parametrize("case", [c for c in CASES if c[4]], ids=_case_id)
def test_cp_matches_megatron_cp1_mla(case):
    """The MLA cases, so a stack that cannot build MLA skips them by name, with the reason."""
    if not _mla_buildable():
        pytest.skip("Megatron-Core 0.16.1 without Transformer Engine cannot build MLASelfAttention "
                    "(isinstance against a TE placeholder); the MLA case runs on 0.19")
    run_ranks(WORLD, _all_cases, [case])


def _cp1_matches_megatron():
    from megatron_longctx import apply_to_spec
    from megatron_longctx.megatron import cpu_compat

    batch = global_batch(seed=5)
    with cpu_compat.enabled(), megatron_parallel(tp=2):
        for extra in ({}, {"num_query_groups": 1}):
            base = build_gpt(tiny_config(2, 1, **extra), local_spec())
            ref_loss, ref_grads = loss_and_grads(base, batch)
            model = build_gpt(tiny_config(2, 1, **extra), apply_to_spec(local_spec()), seed=7)
            model.load_state_dict(base.state_dict())
            loss, grads = loss_and_grads(model, batch)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=2e-6, msg=lambda m: f"{name}: {m}")


def test_cp1_matches_megatron():
    """With one CP rank (TP=2) the plugin's local path equals Megatron's DotProductAttention."""
    run_ranks(WORLD, _cp1_matches_megatron)


def test_hybrid_on_megatron_hierarchical_groups():
    """--cp-comm-type a2a+p2p with --hierarchical-context-parallel-sizes 2 2: Megatron's own hcp groups."""
    pytest.importorskip("einops", reason="Megatron-Core needs einops to build hierarchical CP groups")
    run_ranks(WORLD, _all_cases, [(1, 4, "a2a+p2p", "auto", False, [2, 2], {})])


def _per_layer_comm_types():
    """A per-layer --cp-comm-type list picks each layer's algorithm by layer_number - 1 (both versions)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.config import ContextParallelConfig
    from megatron_longctx.megatron.core_attention import ContextParallelAttention

    with cpu_compat.enabled(), megatron_parallel(cp=2):
        cfg = tiny_config(1, 2, cp_comm_type=["a2a", "p2p"])
        algos = [
            ContextParallelAttention(cfg, layer_number=n, attn_mask_type=AttnMaskType.causal,
                                     cp_comm_type="ignored-when-the-config-holds-a-list",
                                     cp_config=ContextParallelConfig()).settings.algorithm
            for n in (1, 2)
        ]
        assert algos == ["ulysses", "ring"], algos


def _per_layer_gpt():
    from megatron.core import parallel_state

    from megatron_longctx import apply_to_spec
    from megatron_longctx.megatron import cpu_compat

    with cpu_compat.enabled(), megatron_parallel(cp=2):
        cfg = tiny_config(1, 2, cp_comm_type=["a2a", "all_gather"])
        model = build_gpt(cfg, apply_to_spec(local_spec()))
        got = [layer.self_attention.core_attention.settings.algorithm for layer in model.decoder.layers]
        assert got == ["ulysses", "allgather"], got
        assert parallel_state.get_context_parallel_world_size() == 2


def test_per_layer_cp_comm_type():
    run_ranks(WORLD, _per_layer_comm_types)


def test_per_layer_cp_comm_type_in_gpt():
    import inspect

    from megatron.core.transformer import transformer_layer

    if "self.layer_number - 1" not in inspect.getsource(transformer_layer.TransformerLayer.__init__):
        pytest.skip("this Megatron-Core (0.16) indexes per-layer cp_comm_type lists by layer_number, one past "
                    "the end for the last layer: GPT construction itself fails before our module is built")
    run_ranks(WORLD, _per_layer_gpt)
