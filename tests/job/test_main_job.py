"""The main job (``megatron-longctx run``) on Megatron-LM's ``pretrain``: it trains, saves every N steps
plus a final checkpoint, resumes bit for bit over 3 steps, matches baseline Megatron, checks its flags."""

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest
import torch

from megatron_longctx.job import checkpoint_guard as guard
from megatron_longctx import data as data_mod
from megatron_longctx.job import pretrain
from tests.job import main_job


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """7 steps at CP=2 with a checkpoint every 3 (3, 6) and a final one (7); baseline over 4 steps."""
    out, data, proc = main_job.finished(tmp_path_factory, "main-job", "--train-iters", "7", "--save-interval", "3",
                                        "--baseline-steps", "4")
    return {"out": out, "data": data, "stdout": proc.stdout,
            "summary": json.load(open(os.path.join(out, "summary.json")))}


def test_trains_and_matches_baseline_megatron(job):
    summary = job["summary"]
    plugin, baseline = summary["plugin"], summary["baseline"]
    assert plugin["variant"]["context_parallel_size"] == 2 and baseline["variant"]["context_parallel_size"] == 1
    losses = [r["loss"] for r in plugin["steps"]]
    assert [r["step"] for r in plugin["steps"]] == list(range(1, 8)) and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0], losses  # it learns
    # Baseline Megatron (its own attention, CP=1, DP=2) on the same batches from the same init.
    base = [r["loss"] for r in baseline["steps"]]
    torch.testing.assert_close(torch.tensor(losses[:4]), torch.tensor(base), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in plugin["steps"][:4]]),
                               torch.tensor([r["grad_norm"] for r in baseline["steps"]]), rtol=1e-3, atol=1e-5)
    assert summary["comparison"]["losses_agree"] and summary["comparison"]["steps_compared"] == 4
    rows = main_job.metrics(job["out"])
    assert [r["run"] for r in rows] == ["plugin-cp2"] * 7 + ["resume"] * 3 + ["baseline-cp1"] * 4
    assert all(r["tokens_per_s"] > 0 and len(r["peak_mem_bytes_per_rank"]) == 2 for r in rows)
    assert "loss curves agree" in job["stdout"] and "reproduces steps [4, 5, 6] bit for bit" in job["stdout"]


def test_saves_every_interval_plus_the_final_step(job):
    ckpt = os.path.join(job["out"], "checkpoint")
    assert guard.saved_iterations(ckpt) == [3, 6, 7]
    assert guard.tracker_iteration(ckpt) == 7
    for iteration in (3, 6, 7):  # each one complete and checked against its manifest
        manifest = guard.verify(guard.iteration_dir(ckpt, iteration))
        assert any(name.endswith(".distcp") for name in manifest["files"])


def test_resume_reproduces_three_steps_bit_for_bit(job):
    resume = job["summary"]["resume"]
    assert resume["ok"] and resume["loaded_step"] == 3 and resume["steps"] == [4, 5, 6]
    plugin = {r["step"]: r for r in main_job.metrics(job["out"], "plugin-cp2")}
    for row in main_job.metrics(job["out"], "resume"):
        for key in ("loss", "grad_norm", "lr"):  # exactly equal: weights, Adam state, schedule, data position
            assert row[key] == plugin[row["step"]][key], (row, plugin[row["step"]])
    lrs = [plugin[s]["lr"] for s in (4, 5, 6)]
    assert len(set(lrs)) == 3  # the schedule moves over the compared steps, so it is compared too


def test_resume_without_the_adam_state_differs(job, tmp_path):
    """The 3-step comparison sees the optimizer moments: dropping them (--no-load-optim) changes steps 5 and 6."""
    out = str(tmp_path / "run")
    shutil.copytree(os.path.join(job["out"], "checkpoint"), os.path.join(out, "checkpoint"))
    proc = main_job.run(out, job["data"], "--train-iters", "7", "--save-interval", "3", "--load",
                        os.path.join(out, "checkpoint"), "--ckpt-step", "3", "--no-load-optim", "--no-resume-check",
                        "--no-baseline")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plugin = {r["step"]: r["loss"] for r in main_job.metrics(job["out"], "plugin-cp2")}
    resumed = {r["step"]: r["loss"] for r in main_job.metrics(out, "plugin-cp2")}
    assert sorted(resumed) == [4, 5, 6, 7]
    assert resumed[4] == plugin[4]  # same weights and batch: the first step's loss does not see the moments
    assert resumed[5] != plugin[5] and resumed[6] != plugin[6]


def test_attention_sinks_match_baseline_megatron(job, tmp_path):
    """A gpt-oss-style model (learnable sinks, SwiGLU, RMSNorm, GQA, RoPE) at CP=2 trains as Megatron's own
    attention (SoftmaxOne) does at CP=1: losses and grad norms, so the sinks' gradients are reduced over the
    CP ranks once (DDP's dp_cp) and the optimizer moves them alike.  (Megatron's local attention builds its
    window mask on "cuda", so the alternating windows are compared CP=2 to CP=1 in test_pretrain_gpt_script.)"""
    out = str(tmp_path / "run")
    proc = main_job.run(out, job["data"], "--train-iters", "3", "--baseline-steps", "3", "--no-resume-check",
                        "--softmax-type", "learnable", "--swiglu", "--normalization", "RMSNorm",
                        "--disable-bias-linear")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plugin, base = main_job.metrics(out, "plugin-cp2"), main_job.metrics(out, "baseline-cp1")
    assert [r["step"] for r in plugin] == [r["step"] for r in base] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([r[key] for r in plugin]), torch.tensor([r[key] for r in base]),
                                   rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("flags, named", [
    (["--context-parallel-size", "0"], "--context-parallel-size 0"),
    (["--num-attention-heads", "0"], "--num-attention-heads 0"),
    (["--kv-channels", "0"], "--kv-channels 0"),
    (["--hidden-size", "30"], "--hidden-size 30"),
    (["--num-query-groups", "3"], "--num-query-groups 3"),
    (["--context-parallel-size", "4"], "--context-parallel-size 4"),
    (["--seq-length", "250"], "--seq-length 250"),
    (["--global-batch-size", "3", "--context-parallel-size", "1"], "--global-batch-size 3"),
    (["--train-iters", "-1"], "--train-iters -1"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes 0"),
    (["--nproc-per-node", "0"], "--nproc-per-node 0"),
    (["--attention-dropout", "0.1"], "set --attention-dropout 0"),  # a flag run takes (Megatron's)
    (["--train-iters", "4", "--lr-warmup-iters", "4"], "--lr-warmup-iters 4 must be below --train-iters 4"),
    (["--lr", "1e-4"], "--lr 0.0001 is below --min-lr 0.0002"),
    (["--window-size", "64,2"], "--window-size 64,2: the model's attention is causal"),
    (["--window-size", "256,0"], "--window-size 256,0: the left side covers the whole --seq-length 256"),
    (["--lr-decay-iters", "2"], "--lr-warmup-iters 2 must be below --lr-decay-iters 2"),
])
def test_bad_flags_are_refused_naming_the_flag(tmp_path, capsys, flags, named):
    main_job.skip_without_megatron_training()
    rc = pretrain.main([*main_job.TINY, "--output-dir", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and named in err, err
    assert "Traceback" not in err and not os.path.exists(tmp_path / "run" / "checkpoint")


def test_without_megatron_training_run_says_what_it_needs(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "megatron.training" else
                        real(name, *a))
    assert pretrain.main(["--train-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "megatron.training" in err and ">= 0.19" in err


def test_stdlib_corpus_round_trips_through_megatron_indexed_dataset(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokenizer = data_mod.ByteTokenizer()
    paths = data_mod.stdlib_sources(64 << 10)
    assert len(paths) >= 2 and all(p.endswith(".py") for p in paths)
    prefix = str(tmp_path / "corpus")
    total = data_mod.write_indexed_dataset(prefix, paths, tokenizer)
    ds = IndexedDataset(prefix)
    assert len(ds) == len(paths) and sum(len(ds[i]) for i in range(len(ds))) == total
    doc = ds[1]
    assert doc[-1] == tokenizer.eod and bytes(doc[:-1].astype(np.uint8)) == open(paths[1], "rb").read()
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
