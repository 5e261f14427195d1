"""Continuing a checkpoint that Megatron wrote without the plugin (CP=1, its own attention, 128 tokens) at a
longer length (256) under the plugin at CP=2: the state dict loads strictly (every key the model and
optimizer ask for is in the checkpoint), and with a new RoPE base, Llama-3.1 scaling or YaRN the losses and
grad norms equal Megatron's own attention at CP=1 loading the same checkpoint."""

import os

import pytest
import torch

from megatron_longctx.job import pretrain
from tests.job import main_job
from tests.job.conftest import LONG, digest as _digest

STRICT = ["--dist-ckpt-strictness", "raise_unexpected"]  # a model or optimizer key absent from the checkpoint raises


def _continue(source, name, *flags):
    out = str(source["root"] / name)
    proc = main_job.run(out, source["data"], *LONG, "--load", source["ckpt"], "--no-resume-check", *STRICT, *flags)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(f"successfully loaded checkpoint from {source['ckpt']}") == 2  # plugin and baseline
    assert _digest(source["ckpt"]) == source["digest"]  # the source checkpoint is read, never written
    return main_job.metrics(out, "plugin-cp2"), main_job.metrics(out, "baseline-cp1")


def _assert_equal_runs(plugin, base, steps):
    assert [r["step"] for r in plugin] == [r["step"] for r in base] == steps
    for key, rtol in (("loss", 1e-5), ("grad_norm", 1e-4)):
        torch.testing.assert_close(torch.tensor([r[key] for r in plugin]), torch.tensor([r[key] for r in base]),
                                   rtol=rtol, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


def test_finetune_with_a_new_rope_base_and_llama31_scaling_equals_cp1(source):
    plugin, base = _continue(source, "llama31", "--finetune", "--train-iters", "2", "--baseline-steps", "2",
                             "--rotary-base", "40000", "--use-rope-scaling", "--rope-scaling-factor", "4")
    _assert_equal_runs(plugin, base, [1, 2])  # --finetune: the weights only, from iteration 0


def test_continue_with_yarn_equals_cp1(source):
    plugin, base = _continue(source, "yarn", "--train-iters", "4", "--baseline-steps", "4",
                             "--override-opt_param-scheduler", "--rotary-base", "40000",
                             "--position-embedding-type", "yarn", "--rotary-scaling-factor", "2",
                             "--yarn-original-max-position-embeddings", "128")
    _assert_equal_runs(plugin, base, [3, 4])  # weights, Adam moments and step count from iteration 2


@pytest.mark.parametrize("flags, named", [
    (["--hidden-size", "64"], "--hidden-size: the checkpoint"),
    (["--swiglu"], "--swiglu: the checkpoint"),
    (["--finetune", "--save", "SRC"], "--finetune with --save"),
    (["--make-vocab-size-divisible-by", "128"], "has a vocabulary of 320 tokens"),
])
def test_bad_continuation_is_refused_naming_the_flag(source, tmp_path, capsys, flags, named):
    flags = [source["ckpt"] if f == "SRC" else f for f in flags]
    rc = pretrain.main([*main_job.TINY, *LONG, "--output-dir", str(tmp_path / "run"), "--data-dir", source["data"],
                        "--load", source["ckpt"], *flags])
    err = capsys.readouterr().err
    assert rc == 2 and named in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert _digest(source["ckpt"]) == source["digest"] and not os.path.exists(tmp_path / "run" / "checkpoint")


@pytest.mark.parametrize("flags, named", [
    (["--use-rope-scaling"], "--use-rope-scaling: megatron-core"),
    (["--position-embedding-type", "yarn"], "--position-embedding-type yarn: megatron-core"),
])
def test_a_rope_option_the_installed_megatron_lacks_is_refused(monkeypatch, flags, named):
    """A GPTModel without rope_scaling or YaRN (megatron-core before they were added) is refused by flag."""
    import megatron.core.models.gpt as gpt

    from megatron_longctx.job import continuation

    class OlderGPTModel:
        def __init__(self, config, transformer_layer_spec, vocab_size, max_sequence_length,
                     position_embedding_type: str = "learned_absolute", rotary_base: int = 10000):
            pass

    monkeypatch.setattr(gpt, "GPTModel", OlderGPTModel)
    with pytest.raises(ValueError, match=named):
        continuation.check_rope_options(flags)
    continuation.check_rope_options(["--rotary-base", "500000"])  # a RoPE base alone needs nothing new
