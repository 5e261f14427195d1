"""The scaling benchmark: growth fits, the budget's stopping rule, the planner beside the measurement, its
files and flags (with a stand-in for the training runs), and one tiny real run through pretrain_gpt.py."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from megatron_longctx import cli
from megatron_longctx.bench import scaling
from megatron_longctx.bench import scaling_report as report
from megatron_longctx.megatron.lm_scripts import ScriptRun
from tests.megatron_lm import require_scripts, require_training

MIB = 2**20


def _log_line(iteration: int, iters: int, seconds: float) -> str:
    return (f" [2026-12-03 17:00:00.000000] iteration {iteration:8d}/{iters:8d} | consumed samples: {iteration:12d} | "
            f"elapsed time per iteration (ms): {seconds * 1000:.1f} | lm loss: 5.5E+00 |")


class FakeRunner:
    """Stands in for pretrain_gpt.py: step time and peak memory from formulas of the sequence length."""

    def __init__(self, step_s, peak_mib, fail_at=(), oom_at=()):
        self.step_s, self.peak_mib, self.fail_at, self.oom_at = step_s, peak_mib, set(fail_at), set(oom_at)
        self.calls = []

    def __call__(self, series, args, limits):
        seq = int(args[args.index("--seq-length") + 1])
        iters = int(args[args.index("--train-iters") + 1])
        self.calls.append((series.name, seq, iters, limits))
        if seq in self.fail_at:
            output = ("[rank1]: Traceback ...\n[rank1]: RuntimeError: boom\n    raise ChildFailedError(\n"
                      "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
            return ScriptRun(1, output, [], 3.0, 100 * MIB)
        if seq in self.oom_at:  # run_measured killed it at the memory limit
            return ScriptRun(137, _log_line(1, iters, 1.0), [], 5.0, limits.rss_limit_bytes + 1, over_memory=True)
        # the first step is slower (warm-up): only the last is timed
        output = "\n".join(_log_line(i, iters, self.step_s(seq) * (3 if i == 1 and iters > 1 else 1))
                           for i in range(1, iters + 1))
        return ScriptRun(0, output, [{"iteration": i, "lm loss": 5.0 + i} for i in range(1, iters + 1)], 10.0,
                         int(self.peak_mib(seq) * MIB))


def _args(*extra):
    parser = scaling.build_parser()
    args = parser.parse_args(["--output-dir", "unused", *extra])
    scaling.check_args(parser, args)
    return args


def test_fit_exponent_recovers_power_laws():
    xs = [4096, 16384, 65536, 262144]
    assert report.fit_exponent(xs, [3e-9 * x**2 for x in xs]) == pytest.approx(2.0)
    assert report.fit_exponent(xs, [7.0 * x for x in xs]) == pytest.approx(1.0)
    assert report.fit_exponent(xs, [5.0] * 4) == pytest.approx(0.0)
    # least squares over noisy points: slope of the regression line, by hand
    ys = [1.0, 4.5, 15.0, 70.0]
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / 4, sum(ly) / 4
    slope = sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)
    assert report.fit_exponent(xs, ys) == pytest.approx(slope)
    assert report.fit_exponent([4096], [1.0]) is None and report.fit_exponent(xs[:2], [1.0, 0.0]) is None


def test_predicted_step_follows_the_cost_model():
    cost = lambda s: 0.5 + 2e-5 * s + 3e-10 * s**2  # noqa: E731
    pts = [(s, cost(s)) for s in (4096, 8192, 16384)]
    assert scaling.predict_step_s(pts, 65536, degree=2) == pytest.approx(cost(65536), rel=1e-9)
    # one point: scaled by s^degree (an upper bound of any non-negative cost model)
    assert scaling.predict_step_s(pts[:1], 16384, degree=2) == pytest.approx(cost(4096) * 16)
    assert scaling.predict_step_s(pts[:1], 16384, degree=2) >= cost(16384)
    assert scaling.predict_step_s([], 16384, degree=2) is None
    # a window: linear; coefficients never negative, even where a fit with a negative one would be closer
    lin = [(s, 1.0 + 1e-4 * s) for s in (16384, 65536)]
    assert scaling.predict_step_s(lin, 1 << 20, degree=1) == pytest.approx(1.0 + 1e-4 * (1 << 20), rel=1e-9)
    shrinking = [(4096, 2.0), (8192, 1.9), (16384, 1.8)]
    assert scaling.predict_step_s(shrinking, 32768, degree=2) >= 1.8 * 0.9


def _series_rows(runner, lengths, series="causal", **overrides):
    sweep = dict(model=scaling.MODELS["llama-h128"], window=(2048, 0), budget_s=100.0, memory_budget_gib=8.0,
                 single_step_from=1 << 20, startup_s=60.0)
    kw = dict(fixed_mib=None, runner=runner, log=lambda _: None)
    for key, value in overrides.items():
        (sweep if key in sweep else kw)[key] = value
    return scaling.run_series(scaling.SERIES[series], lengths, scaling.SweepSettings(**sweep), **kw)


def test_budget_stops_a_series_before_the_step_that_would_exceed_it():
    runner = FakeRunner(step_s=lambda s: 1e-8 * s**2, peak_mib=lambda s: 500 + s / 1024)
    lengths = [8192, 16384, 32768, 65536, 131072, 262144]
    rows = _series_rows(runner, lengths)
    # 8K: 0.67 s, 16K: 2.7 s, 32K: 10.7 s, 64K: 43 s; 128K would be 172 s > 100 s
    assert [r["status"] for r in rows] == ["ok"] * 4 + ["skipped"] * 2
    assert [c[1] for c in runner.calls] == lengths[:4]
    assert rows[4]["predicted_step_s"] == pytest.approx(1e-8 * 131072**2, rel=1e-6)
    assert "predicted 172 s/step > the 100 s budget" in rows[4]["reason"]
    assert "predicted over the time budget (131072 tokens)" in rows[5]["reason"]
    ok = rows[3]
    assert ok["step_s"] == pytest.approx(1e-8 * 65536**2, rel=1e-3)  # the second step, not the slow first
    assert ok["timed_iteration"] == 2 and ok["loss"] == 7.0
    assert ok["us_per_token"] == pytest.approx(ok["step_s"] / 65536 * 1e6)
    assert ok["peak_mib"] == pytest.approx(564) and ok["mib_per_1k_tokens"] == pytest.approx(564 / 64)
    # the run's limits: killed past start-up + (steps + 1) budgets, or past the memory budget per process
    assert runner.calls[0][3] == scaling.RunLimits(60.0 + 3 * 100.0, 8 << 30)


def test_one_step_from_single_step_from_and_a_measured_step_over_budget_stops():
    # 16K: 16 s, 64K predicted 66 s (runs), measured 80 s: over the 70 s budget, so 256K is not tried
    runner = FakeRunner(step_s=lambda s: s / 1000 if s < 65536 else 80.0, peak_mib=lambda s: 600)
    rows = _series_rows(runner, [16384, 65536, 262144], series="windowed", single_step_from=65536, budget_s=70.0)
    assert [(c[1], c[2]) for c in runner.calls] == [(16384, 2), (65536, 1)]
    assert rows[1]["status"] == "ok" and rows[1]["timed_iteration"] == 1 and rows[1]["over_budget"]
    assert rows[2]["status"] == "skipped" and "took longer than the 70 s budget" in rows[2]["reason"]
    assert "--window-size" in rows[0]["script_args"] and "2048,0" in rows[0]["script_args"]


def test_failure_and_memory_budget_stop_a_series():
    runner = FakeRunner(step_s=lambda s: 1.0, peak_mib=lambda s: 600, fail_at={16384})
    rows = _series_rows(runner, [8192, 16384, 32768])
    assert [r["status"] for r in rows] == ["ok", "failed", "skipped"]
    assert rows[1]["reason"] == "exit code 1: RuntimeError: boom" and "failed" in rows[2]["reason"]
    # a run killed at the memory budget does not fit: skipped, and so is the rest of the series
    runner = FakeRunner(step_s=lambda s: 1.0, peak_mib=lambda s: 600, oom_at={16384})
    rows = _series_rows(runner, [8192, 16384, 32768])
    assert [r["status"] for r in rows] == ["ok", "skipped", "skipped"] and len(runner.calls) == 2
    assert "does not fit: a process passed the 8 GiB memory budget" in rows[1]["reason"]
    assert "did not fit" in rows[2]["reason"]
    # Megatron's own attention keeps s x s scores: the planner puts 32K over a 4 GiB budget, so it never runs
    runner = FakeRunner(step_s=lambda s: 1.0, peak_mib=lambda s: 600)
    rows = _series_rows(runner, [8192, 32768, 65536], series="megatron-causal", memory_budget_gib=4.0)
    assert [r["status"] for r in rows] == ["ok", "skipped", "skipped"] and len(runner.calls) == 1
    assert "GiB per rank > the 4 GiB budget" in rows[1]["reason"]
    assert runner.calls[0][0] == "megatron-causal" and "--context-parallel-size" not in rows[0]["script_args"]


def test_planner_memory_is_the_configuration_s_plus_the_calibrated_footprint():
    model = scaling.MODELS["llama-h128"]
    plugin, megatron = scaling.SERIES["windowed"], scaling.SERIES["megatron-causal"]
    # linear for the plugin (checkpoint offload, tiled MLP and loss), quadratic for Megatron's own attention
    a, b = (scaling.planner_bytes(model, plugin, s) for s in (1 << 18, 1 << 20))
    assert 3.0 < b / a < 4.5
    c, d = (scaling.planner_bytes(model, megatron, s) for s in (8192, 32768))
    assert d / c > 10
    args = scaling.script_args(model, plugin, 1 << 20, (2048, 0), 1)
    assert args[args.index("--longctx-tiled-loss-tiles") + 1] == str((1 << 19) // scaling.LOSS_TILE_TOKENS)
    assert args[args.index("--longctx-offload-target") + 1] == "disk" and "--recompute-granularity" in args

    runner = FakeRunner(step_s=lambda s: 1.0, peak_mib=lambda s: 900 + s / 1024)
    result = scaling.run(_args("--series", "windowed", "--lengths", "16K,64K", "--calibration-length", "2048"),
                         runner=runner)
    cal = result["calibration"]["plugin"]
    assert [c[1] for c in runner.calls] == [2048, 16384, 65536]
    assert cal["fixed_mib"] == pytest.approx(902 - cal["planner_bytes_mib"])
    for row in result["rows"]:
        assert row["planner_mib"] == pytest.approx(row["planner_bytes_mib"] + cal["fixed_mib"])
        assert row["above_fixed_mib"] == pytest.approx(row["peak_mib"] - cal["fixed_mib"])


def test_report_files_and_fits(tmp_path):
    runner = FakeRunner(step_s=lambda s: 2e-9 * s**2, peak_mib=lambda s: 3 * s / 1024)
    args = _args("--series", "causal,megatron-causal", "--causal-lengths", "4K,8K,16K", "--calibration-length", "0",
                 "--output-dir", str(tmp_path))
    seen = []  # main() rewrites the files after every row: an interrupted run keeps what it measured
    result = scaling.run(args, runner=runner, on_update=lambda partial: seen.append(len(partial["rows"])))
    assert seen == [1, 2, 3, 4, 5, 6]
    fit = result["fits"]["causal"]
    assert fit["time_exponent"] == pytest.approx(2.0, abs=1e-3) and fit["memory_exponent"] == pytest.approx(1.0)
    assert fit["mib_per_1k_tokens_ratio"] == pytest.approx(1.0) and fit["longest_measured"] == 16384
    paths = report.write_all(result, str(tmp_path))
    plotted = importlib.util.find_spec("matplotlib") is not None  # the [bench] extra; test-compat has only [test]
    assert [p.rsplit("/", 1)[1] for p in paths] == ["scaling.json", "scaling.md"] + (["scaling.png"] if plotted else [])
    loaded = json.load(open(paths[0]))
    assert loaded["schema"] == report.SCHEMA and len(loaded["rows"]) == 6
    text = open(paths[1]).read()
    assert "| plugin, full causal (CP=2 ring, 2 ranks) | 16K | 0.54 |" in text
    assert "Megatron local attention, full causal (CP=1, 1 rank)" in text and "| 2.00 | 1.00 |" in text
    assert not plotted or open(paths[2], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_dry_run_through_the_cli_and_bad_flags(tmp_path, capsys):
    assert cli.main(["bench", "scaling", "--dry-run", "--no-plots", "--output-dir", str(tmp_path)]) == 0
    rows = json.load(open(tmp_path / "scaling.json"))["rows"]
    windowed = [r for r in rows if r["series"] == "windowed"]
    assert [r["seq_length"] for r in windowed] == [16384, 65536, 262144, 1 << 20]
    assert all(r["status"] == "planned" for r in windowed) and windowed[-1]["steps"] == 1
    assert any(r["status"] == "skipped" and "budget" in r["reason"] for r in rows if r["series"].startswith("megatron"))
    capsys.readouterr()
    for bad, flag in ((["--window", "2048,5"], "--window"), (["--lengths", "16K,10001"], "--lengths"),
                      (["--series", "windowed,nope"], "--series"), (["--budget-s", "0"], "--budget-s"),
                      (["--causal-lengths", "x"], "--causal-lengths"),
                      (["--single-step-from", "256K,1M"], "--single-step-from")):
        with pytest.raises(SystemExit) as exc:
            scaling.main([*bad, "--dry-run", "--output-dir", str(tmp_path)])
        assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_tiny_end_to_end_through_pretrain_gpt(tmp_path):
    """Two windowed lengths through the launcher at CP=2 and one through Megatron's own attention."""
    require_scripts()
    require_training()
    out = tmp_path / "scaling"
    assert scaling.main(["--model", "tiny-h32", "--window", "256,0", "--series", "windowed,megatron-causal",
                         "--lengths", "1024,2048", "--causal-lengths", "1024", "--calibration-length", "0",
                         "--budget-s", "120", "--output-dir", str(out)]) == 0
    result = json.load(open(out / "scaling.json"))
    rows = {(r["series"], r["seq_length"]): r for r in result["rows"]}
    assert set(rows) == {("windowed", 1024), ("windowed", 2048), ("megatron-causal", 1024)}
    for row in rows.values():
        assert row["status"] == "ok", row.get("reason")
        assert row["step_s"] > 0 and row["timed_iteration"] == 2 and math.isfinite(row["loss"])
        assert 100 < row["peak_mib"] < 8192 and row["planner_mib"] > 0
    assert len(rows["windowed", 1024]["rank_peaks_mib_sampled"]) == 2
    assert len(rows["megatron-causal", 1024]["rank_peaks_mib_sampled"]) == 1
    assert result["fits"]["windowed"]["time_exponent"] is not None
    assert (out / "scaling.png").exists() and "| 2K |" in (out / "scaling.md").read_text()
