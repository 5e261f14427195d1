"""``megatron-longctx plan``: every numeric flag is checked with an error naming it; ``--calibrate``;
the TFLOP/s convention, the estimate range and the one-GPU answer in the output."""

from __future__ import annotations

import json

import pytest

from megatron_longctx.plan import presets
from megatron_longctx.plan.cli import main as plan_main
from megatron_longctx.plan.efficiency import load_calibration, resolve

BASE = ["--model", "llama3-8b", "--seq-length", "128K", "--num-gpus", "8"]
BAD = [("--num-gpus", "0"), ("--micro-batch-size", "0"), ("--global-batch-size", "-1"), ("--num-layers", "0"),
       ("--hidden-size", "x"), ("--num-attention-heads", "0"), ("--num-query-groups", "0"), ("--kv-channels", "-8"),
       ("--ffn-hidden-size", "0"), ("--vocab-size", "0"), ("--num-experts", "0"), ("--moe-router-topk", "0"),
       ("--moe-ffn-hidden-size", "0"), ("--gpu-memory-gib", "0"), ("--bf16-tflops", "-5"), ("--fp8-tflops", "-1"),
       ("--nvlink-gbps", "0"), ("--network-gbps", "nan"), ("--host-link-gbps", "0"), ("--host-memory-gib", "0"),
       ("--gpus-per-node", "0"), ("--attention-efficiency", "0"), ("--attention-efficiency", "1.5"),
       ("--matmul-efficiency", "-0.1"), ("--tp", "0"), ("--cp", "0"), ("--pp", "0"), ("--tiled-mlp-tiles", "0"),
       ("--tiled-loss-tiles", "0"), ("--recompute-tiles", "0"), ("--seq-length", "0")]


@pytest.mark.parametrize("flag,value", BAD)
def test_each_numeric_flag_is_checked_and_named(flag, value, capsys):
    argv = [a for a in BASE]
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    with pytest.raises(SystemExit) as info:
        plan_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


@pytest.mark.parametrize("extra,message", [
    (["--num-experts", "2", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "1024"], "--moe-router-topk 4"),
    (["--num-query-groups", "3"], "--num-query-groups 3"),
    (["--pp", "3"], "--pp must divide"),
    (["--gpu", "a100", "--fp8"], "--fp8"),
])
def test_combinations_are_refused_naming_the_flag(extra, message, capsys):
    assert plan_main(BASE + extra) == 2
    assert message in capsys.readouterr().err


def test_output_names_the_convention_and_prints_a_range(capsys):
    assert plan_main(BASE) == 0
    out = capsys.readouterr().out
    assert "num_floating_point_operations convention" in out and "NeMo's convention" in out
    assert "range" in out and "efficiencies: attention" in out


def test_one_h200_states_the_longest_sequence_with_and_without_model_state_offload(capsys):
    assert plan_main(["--model", "llama3-8b", "--seq-length", "2M", "--num-gpus", "1", "--gpu", "h200"]) == 2
    err = capsys.readouterr().err
    assert "longest sequence 1 x h200 trains" in err
    today = err.split("without model-state offload: ")[1].split(" tokens")[0]
    offload = err.split("with model-state offload (--longctx-model-state-offload host): ")[1].split(" tokens")[0]
    assert int(today.replace(",", "")) < (2 << 20) and int(offload.replace(",", "")) > 1.3 * int(today.replace(",", ""))


def _report(tmp_path, name="gpu_check.json", **over):
    report = {"schema": "gpu_check/2", "device": "cuda:0", "dry_run": False, "sections": {
        "environment": {"status": "ok", "name": "NVIDIA H200", "matmul_bf16_tflops": 790.0},
        "kernels": {"status": "ok", "tflops": {"sdpa_cuda": {"bfloat16": {"fwd": 400.0, "bwd": 320.0, "seq": 16384,
                                                                          "heads": [32, 8, 128]}}}},
        "ring": {"status": "ok", "rows": [{"layout": "causal", "cp": 2, "efficiency": 0.9},
                                          {"layout": "causal", "cp": 8, "efficiency": 0.8},
                                          {"layout": "window", "cp": 8, "efficiency": 0.5}]}}}
    report.update(over)
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return str(path)


def test_calibrate_reads_measured_rates(tmp_path, capsys):
    path = _report(tmp_path)
    cal = load_calibration(path, 989.0)
    fwd_bwd = 3.5 / (1 / 400 + 2.5 / 320)  # FLOP-weighted: forward 1 share, backward 2.5
    assert cal.attention_tflops == {"sdpa_cuda": pytest.approx(fwd_bwd)} and cal.matmul_tflops == 790.0
    assert cal.ring_efficiency == 0.8  # causal rows, largest CP
    eff = resolve("hopper", "auto", False, calibration=cal)
    assert eff.attention.expected == pytest.approx(fwd_bwd / 989) and eff.cp_factor == 0.8
    assert eff.matmul.expected == pytest.approx(790 / 989)
    assert eff.point("expected", cp=8)[0] == pytest.approx(fwd_bwd / 989 * 0.8)
    assert plan_main(BASE + ["--calibrate", path]) == 0
    assert f"measured sdpa_cuda in {path}" in capsys.readouterr().out


def test_calibrate_refuses_what_measured_nothing(tmp_path, capsys):
    for bad, message in ((_report(tmp_path, "dry.json", dry_run=True), "dry run"),
                         (str(tmp_path / "missing.json"), "cannot read"),
                         (_report(tmp_path, "empty.json", sections={"kernels": {"status": "skipped"}}),
                          "no measured rate")):
        assert plan_main(BASE + ["--calibrate", bad]) == 2
        err = capsys.readouterr().err
        assert "--calibrate" in err and message in err


def test_flags_override_defaults():
    eff = resolve("hopper", "auto", False, attention=0.4, matmul=0.7)
    assert eff.point("expected", cp=8) == (0.4, 0.7)  # an in-step value: no CP factor on top
    assert resolve("hopper", "te_cudnn", True).point("expected", cp=8)[0] == pytest.approx(0.32, abs=0.005)
    assert presets.gpu("h200").family == "hopper"


def test_te_cudnn_plans_say_they_time_megatrons_own_attention(capsys):
    assert plan_main(BASE + ["--attention-backend", "te_cudnn", "--fp8"]) == 0
    out = capsys.readouterr().out
    assert "te_cudnn times Megatron's own Transformer Engine attention" in out and "--fp8-format hybrid" in out
