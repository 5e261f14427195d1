"""Megatron's own recompute (selective core_attn, full uniform/block) around ContextParallelAttention at CP=2."""

import torch

from tests.dist import run_ranks, megatron_parallel
from tests.gpt_kit import WORLD, build_gpt, local_spec, loss_and_grads, tiny_config
from tests.gpt_kit import batch as global_batch

RECOMPUTE = [
    {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
]


def _recompute_same_grads(comm):
    from megatron.core import parallel_state

    from megatron_longctx import apply_to_spec
    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.megatron.batch import get_batch_on_this_cp_rank
    from megatron_longctx.megatron.core_attention import ContextParallelAttention

    batch = global_batch(seed=3)
    with cpu_compat.enabled(), megatron_parallel(cp=2):
        cp_group = parallel_state.get_context_parallel_group()
        local = get_batch_on_this_cp_rank(batch, cp_group)
        total = batch["loss_mask"].sum()
        spec = apply_to_spec(local_spec())
        plain = build_gpt(tiny_config(1, 2, cp_comm_type=comm), spec)
        ref_loss, ref_grads = loss_and_grads(plain, local, cp_group, total)
        for extra in RECOMPUTE:
            model = build_gpt(tiny_config(1, 2, cp_comm_type=comm, **extra), spec, seed=5)
            model.load_state_dict(plain.state_dict())
            calls = []
            for m in model.modules():
                if isinstance(m, ContextParallelAttention):
                    m.register_forward_hook(lambda *_: calls.append(1))
            loss, grads = loss_and_grads(model, local, cp_group, total)
            expected_calls = {"selective": 4, "uniform": 4, "block": 3}[
                extra.get("recompute_method", "selective") if extra["recompute_granularity"] == "full" else "selective"]
            assert len(calls) == expected_calls, (extra, len(calls))  # forward + recompute in backward
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
            assert grads.keys() == ref_grads.keys()
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-7, msg=lambda m: f"{extra} {name}: {m}")


def test_recompute_gives_the_same_gradients():
    run_ranks(WORLD, _recompute_same_grads, "p2p")
