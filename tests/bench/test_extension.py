"""``bench extension``: the phases hand the checkpoint on (pretrain -> eval, extend -> eval), the RoPE base
follows the NTK rule unless given, and the report compares the two evaluations bin by bin."""

import math

from megatron_longctx.bench import extension


def _value(argv, flag):
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


def test_phases_hand_the_checkpoint_on_and_evaluate_at_the_long_length(tmp_path):
    own, megatron = extension.build_parser().parse_known_args(
        ["--output-dir", str(tmp_path), "--short", "1024", "--long", "16384", "--hidden-size", "256"])
    names = [name for name, _, _ in extension.phases(own, megatron)]
    assert names == ["pretrain", "eval-before", "extend", "eval-after"]
    (_, pre, _), (_, before, _), (_, ext, _), (_, after, _) = extension.phases(own, megatron)
    assert pre[0] == "run" and _value(pre, "--seq-length") == "1024" and _value(pre, "--hidden-size") == "256"
    assert _value(pre, "--data-passkeys") == "3000" and _value(pre, "--context-parallel-size") == "1"
    checkpoint = _value(pre, "--output-dir") + "/checkpoint"
    assert _value(before, "--load") == checkpoint and _value(ext, "--load") == checkpoint
    assert _value(ext, "--stages") == "16384:60"
    assert _value(after, "--load").endswith("extend/stage1-16384/checkpoint")
    for ev in (before, after):
        assert ev[0] == "eval" and _value(ev, "--seq-length") == "16384"
        assert _value(ev, "--passkey-lengths") == "1024,4096,16384"
    # the base: pretraining's before, the extended one after; head dim 256 / 4 heads = 64
    assert _value(before, "--rotary-base") == "10000"
    assert _value(ext, "--rotary-base") == _value(after, "--rotary-base") == str(extension.ntk_base(10000, 1024, 16384, 64))
    own.extend_rotary_base = 500000
    assert _value(extension.phases(own, megatron)[2][1], "--rotary-base") == "500000"


def test_ntk_base_spans_the_long_length_with_the_lowest_frequency():
    base, short, long, d = 10000, 1024, 16384, 32
    new = extension.ntk_base(base, short, long, d)
    # the lowest RoPE frequency is base^(-(d-2)/d); its wavelength grows by long/short
    ratio = (new / base) ** ((d - 2) / d)
    assert math.isclose(ratio, long / short, rel_tol=1e-4)


def _eval(losses, accuracy):
    bins = [{"start": 256 * i, "end": 256 * (i + 1), "tokens": 100, "loss": loss} for i, loss in enumerate(losses)]
    digits = [[0.6 * a + 0.2 for a in row] for row in accuracy]
    return {"position_loss": {"bins": bins}, "passkey": {"lengths": [256, 1024], "depths": [0.0, 1.0],
                                                         "accuracy": accuracy, "digit_accuracy": digits}}


def test_report_compares_accuracy_per_length_and_the_loss_beyond_the_short_length():
    result = {"eval-before": _eval([3.0, 4.0, 5.0, 6.0], [[1.0, 0.0], [0.0, 0.0]]),
              "eval-after": _eval([2.5, 3.0, 3.5, 4.5], [[1.0, 1.0], [0.5, 0.0]])}
    table = extension.report(result, 256)
    assert "| 256 | 0.50 | 1.00 | 0.50 | 0.80 |" in table and "| 1024 | 0.00 | 0.25 | 0.20 | 0.35 |" in table
    assert "| 0-256 (within the pretrained length) | 3.0000 | 2.5000 |" in table
    assert "| 256-512 | 4.0000 | 3.0000 |" in table
    assert "| beyond 256 (token-weighted) | 5.0000 | 3.6667 |" in table
