"""``megatron-longctx eval``: a checkpoint Megatron wrote at 128 tokens, evaluated at 256 under the plugin at
CP=2 (with and without the memory features), gives per position the loss Megatron's own attention gives at
CP=1 on the same tokens, and the same passkey table; the passkey prompts hold their key where they say."""

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_longctx.data import ByteTokenizer
from megatron_longctx.job import evaluate, passkey
from tests.job import main_job
from tests.job.conftest import LONG, digest

SHAPE = main_job.TINY[:10]  # the model's flags, without the run's own


def _eval(source, name, *flags):
    out = str(source["root"] / name)
    argv = [sys.executable, "-m", "megatron_longctx.cli", "eval", *SHAPE, *LONG, "--load", source["ckpt"],
            "--output-dir", out, "--data-dir", source["data"], "--data-max-bytes", str(1 << 20), "--rotary-base",
            "40000", "--position-bins", "256", "--passkey-lengths", "128,256", "--passkey-depths", "0,1",
            "--passkey-trials", "1", *flags]
    proc = subprocess.run(argv, env=main_job.env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"successfully loaded checkpoint from {source['ckpt']}" in proc.stdout
    assert digest(source["ckpt"]) == source["digest"]
    return out, json.load(open(os.path.join(out, "eval.json")))


def test_eval_under_cp_equals_megatrons_own_forward_per_token(source):
    out, plugin = _eval(source, "eval-cp2")
    _, base = _eval(source, "eval-megatron", "--megatron-attention")
    assert (plugin["context_parallel_size"], base["context_parallel_size"]) == (2, 1)
    assert base["attention"] == "megatron" and plugin["attention"] == "plugin"
    a, b = plugin["position_loss"], base["position_loss"]
    assert len(a["per_token"]) == 256 and [x["tokens"] for x in a["bins"]] == [x["tokens"] for x in b["bins"]]
    torch.testing.assert_close(torch.tensor(a["per_token"], dtype=torch.float64),
                               torch.tensor(b["per_token"], dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert plugin["passkey"]["accuracy"] == base["passkey"]["accuracy"]
    assert plugin["passkey"]["digit_accuracy"] == base["passkey"]["digit_accuracy"]
    for row, digit_row in zip(plugin["passkey"]["accuracy"], plugin["passkey"]["digit_accuracy"]):
        assert all(0 <= a <= d <= 1 for a, d in zip(row, digit_row))  # a retrieved key has all its digits right
    assert len(plugin["peak_mem_bytes_per_rank"]) == 2 and min(plugin["peak_mem_bytes_per_rank"]) > 0
    assert plugin["seconds"] > 0
    # the memory features (tiled MLP and loss, Megatron's full recompute run by the plugin) change nothing
    _, tiled = _eval(source, "eval-memory", "--longctx-tiled-mlp-tiles", "2", "--longctx-tiled-loss-tiles", "2",
                     "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    torch.testing.assert_close(torch.tensor(tiled["position_loss"]["per_token"], dtype=torch.float64),
                               torch.tensor(a["per_token"], dtype=torch.float64), rtol=1e-5, atol=1e-6)
    assert tiled["passkey"]["accuracy"] == plugin["passkey"]["accuracy"]
    assert len(plugin["passkey"]["accuracy"]) == 2 and len(plugin["passkey"]["accuracy"][0]) == 2
    for name in ("position_loss.png", "passkey.png"):
        assert open(os.path.join(out, name), "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("length", [160, 1024])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_passkey_prompt_holds_its_key_where_it_says(length, depth):
    tok = ByteTokenizer()
    prompt = passkey.make(length, depth, seed=7)
    assert len(prompt.tokens) == length and len(prompt.key) == passkey.DIGITS and prompt.key.isdigit()
    assert tok.detokenize(prompt.tokens[slice(*prompt.needle_key)]) == prompt.key
    assert tok.detokenize(prompt.tokens[slice(*prompt.answer)]) == prompt.key
    assert prompt.answer == (length - passkey.DIGITS, length)
    text = tok.detokenize(prompt.tokens)
    assert text.count(prompt.key) == 3  # twice in the needle, once as the answer
    assert abs(prompt.depth - depth) <= 1 / length  # the needle starts at the asked depth of the filler
    assert passkey.make(length, depth, seed=8).key != prompt.key


def test_passkey_corpus_adds_training_prompts_as_documents_of_their_own(tmp_path):
    """``--data-passkeys``: the stdlib documents first, then the prompts, each EOD-terminated, lengths up to
    the run's --seq-length, keys of a seed stream apart from eval's."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_longctx import data as data_mod

    tok = ByteTokenizer()
    docs = passkey.documents(40, 300)
    assert docs == passkey.documents(40, 300) and len(docs) == 40
    assert all(2 * passkey.minimum_length() <= len(d) <= 300 for d in docs)
    assert len({len(d) for d in docs}) > 20  # lengths spread over the range
    keys = {tok.detokenize(d[-passkey.DIGITS:]) for d in docs}
    evals = {passkey.make(256, 0.5, seed=1000 * t + 17).key for t in range(8)}
    assert len(keys) == 40 and not keys & evals
    for d in docs:  # every prompt holds its key in its needle and answers it at its end
        text, key = tok.detokenize(d), tok.detokenize(d[-passkey.DIGITS:])
        assert passkey.needle(key) in text and text.endswith(passkey.question(key))

    prefix = data_mod.ensure_stdlib_dataset(str(tmp_path), 64 << 10, tok, ("passkeys40x300", lambda: docs))
    assert prefix.endswith("stdlib_65536_passkeys40x300")
    ds, files = IndexedDataset(prefix), data_mod.stdlib_sources(64 << 10)
    assert len(ds) == len(files) + len(docs)
    for i, d in enumerate(docs):
        assert ds[len(files) + i].tolist() == [*d, tok.eod]
    with pytest.raises(ValueError, match="--data-passkeys: prompts need at least"):
        passkey.documents(1, passkey.minimum_length())


@pytest.mark.parametrize("flags, named", [
    (["--passkey-lengths", "300"], "--passkey-lengths 300"),
    (["--passkey-lengths", "130"], "--passkey-lengths 130"),
    (["--passkey-depths", "1.5"], "--passkey-depths 1.5"),
    (["--eval-batches", "0"], "--eval-batches 0"),
    (["--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt"),
])
def test_bad_eval_input_is_refused_naming_the_flag(tmp_path, capsys, flags, named):
    main_job.skip_without_megatron_training()
    argv = [*SHAPE, *LONG, "--load", str(tmp_path), "--output-dir", str(tmp_path / "eval"), *flags]
    assert evaluate.main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err
