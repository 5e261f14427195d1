"""Mixed short/long batches (``run --mix-short``, ``extend``'s ``LENGTH:STEPS@SHORT:FRACTION``): the steps read
batches of the lengths the mix asks for, the plugin at CP=2 equals Megatron's own attention at CP=1 on the same
mixed batches, and a resumed run continues the pattern bit for bit."""

import json
import os
import re

import pytest
import torch

from megatron_longctx.job import extend, mix
from tests.job import main_job


def test_short_steps_are_spread_evenly():
    assert [mix.is_short(k, 0.5) for k in range(1, 7)] == [False, True] * 3
    assert [k for k in range(1, 13) if mix.is_short(k, 0.25)] == [4, 8, 12]
    for fraction in (0.1, 0.3, 0.5, 0.75, 0.9):
        for n in (1, 7, 40):
            assert sum(mix.is_short(k, fraction) for k in range(1, n + 1)) == int(n * fraction)
    assert [mix.step_length(k, 1 << 20, mix.Mix(4096, 0.5)) for k in (1, 2)] == [1 << 20, 4096]
    assert mix.step_length(2, 1 << 20, None) == 1 << 20


def test_a_step_draws_all_its_samples_from_one_length():
    long, short = [("long", i) for i in range(24)], [("short", i) for i in range(24)]
    data = mix.MixedLengthDataset(long, short, global_batch_size=3, mix=mix.Mix(64, 0.5))
    assert len(data) == 24
    for index in range(24):
        step = index // 3 + 1
        assert data[index] == (("short" if step % 2 == 0 else "long"), index)


@pytest.mark.parametrize("text, named", [
    ("4K", "--mix-short '4K' is not SHORT:FRACTION; write e.g. 4K:0.5"),
    ("4K:half", "--mix-short '4K:half' is not SHORT:FRACTION"),
    ("4K:1", "--mix-short '4K:1': the short length must be >= 1 and the fraction of short steps strictly between "
             "0 and 1"),
    ("0:0.5", "--mix-short '0:0.5': the short length must be >= 1"),
])
def test_bad_mixes_name_the_flag_and_the_fix(text, named):
    with pytest.raises(ValueError, match="^" + re.escape(named)):
        mix.parse(text)


def test_a_short_length_at_or_above_the_run_or_uneven_under_cp_is_refused():
    with pytest.raises(ValueError, match=r"--mix-short 256:0.5: the short length must be below --seq-length 256"):
        mix.check(mix.Mix(256, 0.5), 256, 2)
    with pytest.raises(ValueError, match=r"multiple of 2 x --context-parallel-size \(4\); choose e.g. 96:0.5"):
        mix.check(mix.Mix(98, 0.5), 256, 2)
    mix.check(mix.Mix(98, 0.5), 256, 1)  # no CP: any length


def test_extend_hands_each_stage_its_mix():
    own, rest = extend.build_parser().parse_known_args(
        ["--stages", "128:2,1K:4@64:0.25", "--output-dir", "/nonexistent/extend"])
    stages = extend.parse_stages(own.stages)
    assert stages == [(128, 2, None), (1024, 4, mix.Mix(64, 0.25))]
    first, _ = extend.stage_argv(own, rest, 0, stages, None)
    second, record = extend.stage_argv(own, rest, 1, stages, None)
    assert "--mix-short" not in first
    assert second[second.index("--mix-short") + 1] == "64:0.25" and record["mix_short"] == {"short": 64,
                                                                                              "fraction": 0.25}


@pytest.mark.parametrize("stages, named", [
    ("1K:4@64", "--stages '1K:4@64': after '@' in '1K:4@64', '64' is not SHORT:FRACTION; write e.g. 4K:0.5"),
    ("1K:4@64:2", "--stages '1K:4@64:2': after '@' in '1K:4@64:2', '64:2': the short length must be >= 1 and the "
                  "fraction of short steps strictly between 0 and 1"),
    ("128:2,1K:4@1K:0.5", "'1K:4@1K:0.5' mixes in 1024-token batches, not shorter than the stage's 1024; give a "
                          "shorter one, e.g. 1K:4@128:0.5"),
    ("1K:4@66:0.5", "--stages '1K:4@66:0.5': stage 1 mixes 66:0.5: the short length must be a multiple of 2 x "
                    "--context-parallel-size (4); choose e.g. 64:0.5"),
])
def test_bad_stage_mixes_are_refused_naming_the_flag(tmp_path, capsys, stages, named):
    assert extend.main(["--output-dir", str(tmp_path / "x"), "--stages", stages]) == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "x")


def test_mixed_batches_follow_the_mix_equal_megatron_and_resume_exactly(tmp_path):
    main_job.skip_without_megatron_training()
    out = str(tmp_path / "run")
    proc = main_job.run(out, str(tmp_path / "data"), "--train-iters", "4", "--mix-short", "64:0.5",
                        "--baseline-steps", "4", "--resume-check-steps", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plugin, base = main_job.metrics(out, "plugin-cp2"), main_job.metrics(out, "baseline-cp1")
    resumed = main_job.metrics(out, "resume")
    # the lengths the steps' batches had, as get_batch read them
    assert [r["seq_length"] for r in plugin] == [256, 64, 256, 64]
    assert [r["seq_length"] for r in base] == [256, 64, 256, 64]
    assert [(r["step"], r["seq_length"]) for r in resumed] == [(3, 256), (4, 64)]
    assert [r["tokens"] for r in plugin] == [2 * 256, 2 * 64, 2 * 256, 2 * 64]  # global batch 2
    # the plugin at CP=2 on the mixed batches equals Megatron's own attention at CP=1 on the same batches
    torch.testing.assert_close(torch.tensor([r["loss"] for r in plugin], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in base], dtype=torch.float64), rtol=1e-4, atol=0)
    for new, old in zip(resumed, plugin[2:]):  # the reloaded run continues the pattern bit for bit
        assert (new["loss"], new["grad_norm"], new["lr"]) == (old["loss"], old["grad_norm"], old["lr"])
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["mix_short"] == {"short": 64, "fraction": 0.5} and summary["resume"]["ok"]
