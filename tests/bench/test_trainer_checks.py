"""The benchmark's in-process Trainer (bench/engine.py) refuses bad shapes and layouts naming the flag."""

import dataclasses
import json

import pytest
import torch

from megatron_longctx.bench.engine import GPTShape
from megatron_longctx.plan.model import ModelShape
from tests.dist import run_ranks

# A GELU MLP, LayerNorm and linear biases: Megatron's defaults (ModelShape's are Llama's)
SMALL = ModelShape(name="small", num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                   kv_channels=8, ffn_hidden_size=64, vocab_size=320, activation="gelu", normalization="LayerNorm",
                   add_bias_linear=True)


@pytest.mark.parametrize("model, seq_length, flag", [
    (dict(hidden_size=30, kv_channels=7), 128, "--hidden-size"),
    (dict(num_query_groups=3), 128, "--num-query-groups"),
    (dict(normalization="BatchNorm"), 128, "--normalization"),
    ({}, 0, "--seq-length"),
])
def test_bad_model_shape_names_the_flag(model, seq_length, flag):
    with pytest.raises(ValueError, match=flag):
        GPTShape(dataclasses.replace(SMALL, **model), seq_length)


def test_a_model_the_benchmark_gpt_does_not_build_is_refused_by_name():
    from megatron_longctx.plan import presets

    with pytest.raises(ValueError, match="mixtral-8x7b: .*--num-experts"):
        GPTShape(presets.model("mixtral-8x7b"))
    llama = presets.model("llama3-8b")
    with pytest.raises(ValueError, match="rotary_base=10000"):  # Llama-3's RoPE base is 500,000
        GPTShape(llama)
    llama = dataclasses.replace(llama, rotary_base=10000)  # 4096 / 32 heads = 128, its head dimension
    assert GPTShape(llama).model is llama
    with pytest.raises(ValueError, match="--kv-channels 64: .* = 128"):
        GPTShape(dataclasses.replace(llama, kv_channels=64))


def test_the_shape_a_probe_task_carries_comes_back_whole():
    shape = GPTShape(SMALL, 64, dropout=0.1, bf16=True)
    record = json.loads(json.dumps(shape.to_dict()))
    assert "seq_length" not in record and record["num_layers"] == 1 and record["bf16"] is True
    assert GPTShape.from_dict(record, 64) == shape
    assert GPTShape.from_dict(record, 128).seq_length == 128


def _bad_layout(argv):
    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.bench.engine import OptimConfig, Trainer, Variant

    shape = GPTShape(SMALL, seq_length=130)
    messages = []
    with cpu_compat.enabled():
        for variant, gbs in ((Variant("p", context_parallel_size=2, plugin=True), 2), (Variant("b"), 3)):
            try:
                Trainer(shape if variant.plugin else GPTShape(SMALL, seq_length=128), variant, OptimConfig(), gbs, 1)
            except ValueError as exc:
                messages.append(str(exc))
    return messages


def test_bad_layout_names_the_flag():
    messages = run_ranks(2, _bad_layout, [])[0]
    assert len(messages) == 2
    assert "--seq-length 130" in messages[0] and "--context-parallel-size" in messages[0]
    assert "--global-batch-size 3" in messages[1]


def _steps(materialize: bool):
    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.bench import engine
    from megatron_longctx.bench.engine import OptimConfig, Trainer, Variant

    shape = GPTShape(SMALL, seq_length=32)
    g = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, 256, (2, 32), generator=g), "labels": torch.randint(0, 256, (2, 32), generator=g),
                "loss_mask": torch.ones(2, 32), "position_ids": torch.arange(32).expand(2, 32)} for _ in range(3)]
    original = engine.materialize_optimizer_state
    if not materialize:
        engine.materialize_optimizer_state = lambda optimizer: None
    try:
        with cpu_compat.enabled():
            trainer = Trainer(shape, Variant("p", context_parallel_size=2, plugin=True), OptimConfig(), 1, 1)
            opts = engine._torch_optimizers(trainer.optimizer)
            before = sum(len(o.state) for o in opts)
            results = [trainer.step(i, b) for i, b in enumerate(batches)]
            params = [p.detach().clone() for p in trainer.model.parameters()]
            trainer.close()
    finally:
        engine.materialize_optimizer_state = original
    return before, [(r.loss, r.grad_norm) for r in results], params


def test_optimizer_state_exists_before_the_first_step_and_changes_nothing():
    """A one-step probe must see Adam's moments (torch makes them inside the first step)."""
    eager, lazy = run_ranks(2, _steps, True)[0], run_ranks(2, _steps, False)[0]
    assert eager[0] > 0 and lazy[0] == 0
    assert eager[1] == lazy[1]  # losses and grad norms, bit for bit
    for a, b in zip(eager[2], lazy[2]):
        assert torch.equal(a, b)


def _optimizer_steps(distributed: bool, plugin: bool):
    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.bench import engine
    from megatron_longctx.bench.engine import OptimConfig, Trainer, Variant

    shape = GPTShape(SMALL, seq_length=32)
    g = torch.Generator().manual_seed(0)
    batches = [{"tokens": torch.randint(0, 256, (2, 32), generator=g), "labels": torch.randint(0, 256, (2, 32), generator=g),
                "loss_mask": torch.ones(2, 32), "position_ids": torch.arange(32).expand(2, 32)} for _ in range(3)]
    variant = Variant("p", context_parallel_size=2, plugin=True) if plugin else Variant("b")  # CP=2 / DP=2
    with cpu_compat.enabled():
        trainer = Trainer(shape, variant, OptimConfig(weight_decay=0.1, distributed=distributed), 2, 1)
        moments = sum(s["exp_avg"].numel() for o in engine._torch_optimizers(trainer.optimizer)
                      for s in o.state.values())
        results = [trainer.step(i, b) for i, b in enumerate(batches)]
        params = [p.detach().clone() for p in trainer.model.parameters()]
        total = sum(p.numel() for p in params)
        trainer.close()
    return moments, total, [r.loss for r in results], [r.grad_norm for r in results], params


@pytest.mark.parametrize("plugin", [True, False], ids=["cp2", "dp2"])
def test_the_distributed_optimizer_trains_as_the_whole_one_with_half_of_adam_per_rank(plugin):
    """The benchmark's default optimizer: Megatron's distributed one shards Adam's moments over DP x CP
    (each rank holds half of them at two ranks, what its memory figures rest on) and trains as each rank
    holding them all."""
    sharded, whole = run_ranks(2, _optimizer_steps, True, plugin), run_ranks(2, _optimizer_steps, False, plugin)
    total = whole[0][1]
    assert all(r[0] == total for r in whole)
    assert sum(r[0] for r in sharded) == total  # every weight's moments on exactly one rank
    for moments, *_ in sharded:  # shards are equal up to the buffer's alignment padding
        assert moments <= total / 2 + 1024
    for a, b in zip(sharded, whole):
        torch.testing.assert_close(a[2], b[2], rtol=0, atol=0)  # losses
        torch.testing.assert_close(a[3], b[3])  # grad norms: the sharded one sums its squares in another order
        for x, y in zip(a[4], b[4]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


def _global_batch_alive_in_forward(made_by_function: bool):
    import weakref

    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.bench.engine import OptimConfig, Trainer, Variant

    shape = GPTShape(SMALL, seq_length=32)
    refs, alive = [], []

    def make():
        batch = {"tokens": torch.randint(0, 256, (1, 32)), "labels": torch.randint(0, 256, (1, 32)),
                 "loss_mask": torch.ones(1, 32), "position_ids": torch.arange(32).expand(1, 32)}
        refs.extend(weakref.ref(t) for t in batch.values())
        return batch

    with cpu_compat.enabled():
        trainer = Trainer(shape, Variant("p", context_parallel_size=2, plugin=True), OptimConfig(), 1, 1)
        trainer.model.register_forward_pre_hook(lambda *_: alive.append(sum(r() is not None for r in refs)))
        trainer.step(0, make if made_by_function else make())
        trainer.close()
    return alive


def test_a_step_given_a_batch_function_holds_only_its_micro_batches():
    """The probe's steps drop the global batch once this rank's CP slices are cut (Megatron's get_batch keeps
    only those); a batch passed as a dict is the caller's, alive through the step."""
    assert run_ranks(2, _global_batch_alive_in_forward, True) == [[0], [0]]
    assert run_ranks(2, _global_batch_alive_in_forward, False) == [[4], [4]]
