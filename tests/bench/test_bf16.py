"""The benchmark under bf16 mixed precision (``--bf16``): Megatron's Float16Module and mixed-precision optimizer
around the same models, losses within bf16 rounding of float32's, and the budget that leaves float32's room.
"""

import json

import torch

from megatron_longctx.bench import regression, report
from megatron_longctx.plan.model import ModelShape, param_counts
from tests.bench.test_bench_end_to_end import TINY
from tests.dist import run_ranks

SMALL = ModelShape(name="small", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   kv_channels=16, ffn_hidden_size=224, vocab_size=512, activation="swiglu", normalization="RMSNorm",
                   add_bias_linear=False)


def _batches(seq, n, vocab):
    g = torch.Generator().manual_seed(3)
    return [{"tokens": torch.randint(0, vocab, (2, seq), generator=g),
             "labels": torch.randint(0, vocab, (2, seq), generator=g),
             "loss_mask": torch.ones(2, seq), "position_ids": torch.arange(seq).expand(2, seq)} for _ in range(n)]


def _train(bf16: bool, plugin: bool):
    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.bench.engine import GPTShape, OptimConfig, Trainer, Variant

    shape = GPTShape(SMALL, seq_length=64, bf16=bf16)
    variant = (Variant("p", context_parallel_size=2, plugin=True,
                       longctx_options=(("cp_algorithm", "allgather"), ("recompute_granularity", "full"),
                                        ("recompute_tiles", 2), ("tiled_loss_tiles", 2)))
               if plugin else Variant("b"))
    with cpu_compat.enabled():
        trainer = Trainer(shape, variant, OptimConfig(), 2, 1)
        dtypes = {p.dtype for p in trainer.model.parameters()}
        results = [trainer.step(i, b) for i, b in enumerate(_batches(64, 3, SMALL.vocab_size))]
        trainer.close()
    return dtypes, [r.loss for r in results], [r.grad_norm for r in results]


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def test_bf16_losses_are_float32_losses_within_bf16_rounding_and_the_plugin_matches_megatron():
    fp32, bf16 = run_ranks(2, _train, False, False)[0], run_ranks(2, _train, True, False)[0]
    plugin = run_ranks(2, _train, True, True)[0]
    assert fp32[0] == {torch.float32} and bf16[0] == {torch.bfloat16} and plugin[0] == {torch.bfloat16}
    for got, want in ((bf16, fp32), (plugin, bf16)):  # bf16 against float32; the plugin against Megatron, both bf16
        assert max(_rel(a, b) for a, b in zip(got[1], want[1])) <= report.BF16_LOSS_RTOL
        assert max(_rel(a, b) for a, b in zip(got[2], want[2])) <= report.BF16_GRAD_NORM_RTOL
    assert max(_rel(a, b) for a, b in zip(bf16[1], fp32[1])) > 0  # it is bf16: not float32's losses bit for bit


def _parameters(shapes):
    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.bench.engine import GPTShape, OptimConfig, Trainer, Variant

    counts = []
    with cpu_compat.enabled():
        for shape in shapes:
            trainer = Trainer(GPTShape.from_dict(shape, 64), Variant("b"), OptimConfig(), 2, 1)
            counts.append(sum(p.numel() for p in trainer.model.parameters()))
            trainer.close()
    return counts


def test_parameter_count_and_the_bf16_budget():
    shapes, models = [], []
    for preset in ("llama-h256", "tiny"):  # SwiGLU, RMSNorm, no biases; GELU, LayerNorm, biases
        args = regression.build_parser().parse_args(["--preset", preset, "--bf16"])
        shapes.append(regression.model_shape(args))
        models.append(regression.bench_model(args))
    assert all(s["bf16"] for s in shapes)
    assert shapes[1]["vocab_size"] == regression.TOKENIZER_VOCAB == 320  # tiny: the tokenizer's own vocabulary
    counts = run_ranks(2, _parameters, [dict(s, bf16=False) for s in shapes])[0]
    assert [param_counts(m).total for m in models] == counts  # the planner counts what Megatron builds
    llama = models[0]
    assert regression._default_budget_mib("llama-h256", llama, bf16=False) == 160.0
    assert regression._default_budget_mib("llama-h256", llama, bf16=True) == 160.0 + 2 * counts[0] / 2**20


def test_bench_end_to_end_in_bf16(tmp_path):
    argv = TINY + ["--bf16", "--output-dir", str(tmp_path), "--seq-lengths", "64", "--skip-max-seq",
                   "--time-check-rounds", "0", "--no-plots", "--configs", "megatron-flash,allgather+all"]
    assert regression.main(argv) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["meta"]["shape"]["bf16"] is True
    points = {p["config"]: p for p in result["sweep"]}
    assert points["megatron-unfused"]["status"] == "ok" and points["allgather+all"]["parity_ok"] is True
    assert "bf16 mixed precision" in (tmp_path / "bench.md").read_text()
