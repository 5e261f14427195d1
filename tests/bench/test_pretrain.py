"""The main job (``megatron-longctx run``) on a tiny model: it trains, resumes exactly, and matches baseline Megatron."""

import json
import os

import numpy as np
import pytest
import torch

from megatron_longctx.megatron import data as data_mod
from megatron_longctx.megatron import pretrain
from megatron_longctx.megatron.training import ModelShape
from tests.dist import run_ranks

TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--ffn-hidden-size", "64", "--seq-length", "256", "--lr", "5e-3", "--no-progress",
        "--data-max-bytes", str(1 << 20)]


def _job(argv):
    args = pretrain.build_parser().parse_args(argv)
    return pretrain.run_worker(args)


def test_tiny_job_trains_resumes_and_matches_baseline(tmp_path):
    argv = TINY + ["--train-steps", "6", "--baseline-steps", "6", "--output-dir", str(tmp_path / "run"),
                   "--data-dir", str(tmp_path / "data")]
    summaries = run_ranks(2, _job, argv)
    summary = summaries[0]
    assert summaries[1]["comparison"] == summary["comparison"]
    plugin, baseline = summary["plugin"], summary["baseline"]
    assert plugin["variant"]["context_parallel_size"] == 2 and plugin["variant"]["plugin"] is True
    assert baseline["variant"]["context_parallel_size"] == 1 and baseline["variant"]["plugin"] is False
    losses = [r["loss"] for r in plugin["steps"]]
    assert len(losses) == 6 and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0] - 0.1, losses  # it learns
    # Resume: a fresh model (other seed) loaded from the step-3 checkpoint reproduces step 4 exactly.
    resume = summary["resume"]
    assert resume["loaded_step"] == 3 and resume["ok"]
    assert resume["resumed_loss"] == pytest.approx(losses[3], rel=1e-6, abs=0)
    # Baseline Megatron (CP=1, DP=2) on the same global batches from the same initialisation.
    assert plugin["init_checksum"] == pytest.approx(baseline["init_checksum"], rel=1e-12)
    base_losses = [r["loss"] for r in baseline["steps"]]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(base_losses), rtol=1e-4, atol=1e-5)
    grad_norms = [r["grad_norm"] for r in plugin["steps"]]
    torch.testing.assert_close(torch.tensor(grad_norms), torch.tensor([r["grad_norm"] for r in baseline["steps"]]),
                               rtol=1e-3, atol=1e-5)
    assert summary["comparison"]["losses_agree"] and summary["comparison"]["steps_compared"] == 6
    # Metrics: one JSON line per step and run, with throughput and memory per rank.
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["run"] for r in rows] == ["plugin-cp2"] * 6 + ["baseline-cp1"] * 6
    assert all(r["tokens_per_s"] > 0 and len(r["peak_mem_bytes_per_rank"]) == 2 for r in rows)
    assert os.path.exists(tmp_path / "run" / "summary.json")
    text = pretrain.render_summary(summary)
    assert "loss curves agree" in text and "reproduces" in text


def test_run_command_launches_torchrun(tmp_path):
    argv = TINY + ["--train-steps", "2", "--no-baseline", "--no-resume-check", "--seq-length", "128",
                   "--output-dir", str(tmp_path / "run"), "--data-dir", str(tmp_path / "data")]
    assert pretrain.main(argv) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(summary["plugin"]["steps"]) == 2
    assert "baseline" not in summary


def test_stdlib_corpus_round_trips_through_megatron_indexed_dataset(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokenizer = data_mod.ByteTokenizer()
    paths = data_mod.stdlib_sources(64 << 10)
    assert len(paths) >= 2 and all(p.endswith(".py") for p in paths)
    prefix = str(tmp_path / "corpus")
    total = data_mod.write_indexed_dataset(prefix, paths, tokenizer)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(paths)
    assert sum(len(ds[i]) for i in range(len(ds))) == total
    text = open(paths[1], "rb").read()
    doc = ds[1]
    assert doc[-1] == tokenizer.eod and bytes(doc[:-1].astype(np.uint8)) == text
    assert tokenizer.detokenize(tokenizer.tokenize("déjà vu")) == "déjà vu"
    assert data_mod.padded_vocab_size(tokenizer) == 320


def test_gpt_dataset_samples_are_shifted_byte_sequences(tmp_path):
    tokenizer = data_mod.ByteTokenizer()
    prefix = str(tmp_path / "corpus")
    data_mod.write_indexed_dataset(prefix, data_mod.stdlib_sources(256 << 10), tokenizer)
    ds = data_mod.build_gpt_dataset(prefix, 128, 8, seed=3, tokenizer=tokenizer)
    batch = data_mod.global_batch(ds, step=1, global_batch_size=2)
    assert batch["tokens"].shape == (2, 128) and batch["labels"].shape == (2, 128)
    torch.testing.assert_close(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert int(batch["tokens"].max()) <= tokenizer.eod
    torch.testing.assert_close(batch["tokens"][0], ds[2]["tokens"])  # step 1, sample 0 = global sample 2


@pytest.mark.parametrize("kwargs, flag", [
    (dict(hidden_size=30, num_attention_heads=4), "--hidden-size"),
    (dict(num_attention_heads=4, num_query_groups=3), "--num-query-groups"),
    (dict(seq_length=0), "--seq-length"),
])
def test_bad_model_shape_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ModelShape(**kwargs)


def _bad_layout(argv):
    from megatron_longctx import cpu_compat
    from megatron_longctx.megatron.training import OptimConfig, Trainer, Variant

    shape = ModelShape(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                       seq_length=130)
    messages = []
    with cpu_compat.enabled():
        for variant, gbs in ((Variant("p", context_parallel_size=2, plugin=True), 2), (Variant("b"), 3)):
            try:
                Trainer(shape if variant.plugin else ModelShape(seq_length=128), variant, OptimConfig(), gbs, 1)
            except ValueError as exc:
                messages.append(str(exc))
    return messages


def test_bad_layout_names_the_flag():
    messages = run_ranks(2, _bad_layout, [])[0]
    assert len(messages) == 2
    assert "--seq-length 130" in messages[0] and "--context-parallel-size" in messages[0]
    assert "--global-batch-size 3" in messages[1]
