"""``megatron-longctx bench`` end to end on a tiny model: JSON schema, parity, enforced budget, --compare exit codes.

Timings are never asserted; the checks are on structure, parity with the baseline and the comparator.
"""

import importlib.util
import json
import os

import pytest

from megatron_longctx.bench import regression, report

TINY = ["--nproc-per-node", "2", "--preset", "tiny", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--ffn-hidden-size", "64", "--steps", "2", "--warmup", "1"]

NEW = ["megatron-flash", "megatron-flash+recompute", "megatron-flash+cp", "megatron-flash+cp+recompute", "ring+all",
       "allgather+all"]
POINT_KEYS = {"config", "seq_length", "status", "step_times_s", "step_time_s", "cpu_s_per_step", "cpu_us_per_token",
              "time_ratio_vs_megatron-flash+recompute", "parity_reference", "tokens_per_s", "model_tflops",
              "peak_mem_bytes_per_rank", "peak_mem_bytes", "losses", "grad_norms", "time_ratio_vs_baseline",
              "mem_ratio_vs_baseline", "loss_max_rel_diff", "grad_norm_max_rel_diff", "parity_ok"}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # The budget is far below what the baseline's quadratic attention needs at 1024 tokens and far above
    # what ring+all needs at 2048: the search must see the baseline die and the plugin fit.
    argv = TINY + ["--output-dir", str(out), "--seq-lengths", "64,128", "--configs", ",".join(NEW),
                   "--max-seq-configs", "megatron-unfused,megatron-flash+cp,ring+all", "--max-seq-start", "1024",
                   "--max-seq-cap", "2048", "--budget-mib", "24"]
    rc = regression.main(argv)
    with open(out / "bench.json") as f:
        return rc, out, json.load(f)


def test_schema_and_outputs(bench_run):
    rc, out, result = bench_run
    assert rc == 0
    assert result["schema"] == report.SCHEMA
    assert {"device", "world_size", "shape", "steps", "warmup", "megatron_core", "torch"} <= set(result["meta"])
    assert [c["name"] for c in result["configs"]] == ["megatron-unfused"] + NEW
    assert all(c["status"] == "ok" for c in result["configs"])
    assert [c["role"] for c in result["configs"]] == ["baseline"] * 5 + ["plugin"] * 2
    assert {(p["config"], p["seq_length"]) for p in result["sweep"]} == {
        (c, s) for c in ["megatron-unfused"] + NEW for s in (64, 128)}
    for p in result["sweep"]:
        assert p["status"] == "ok", p
        assert POINT_KEYS <= set(p), POINT_KEYS - set(p)
        assert len(p["losses"]) == 3 and len(p["step_times_s"]) == 2 and len(p["peak_mem_bytes_per_rank"]) == 2
    assert os.path.getsize(out / "bench.md") > 0
    if importlib.util.find_spec("matplotlib") is not None:  # the plots need the "bench" extra
        for name in ("memory_vs_seq.png", "tokens_per_s_vs_seq.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "bench.md").read_text()
    assert "| ring+all | 128 |" in table and "| allgather+all | 128 |" in table and "Max trainable sequence" in table
    assert "| megatron-flash+cp+recompute | 128 |" in table
    model_line = next(line for line in table.splitlines() if line.startswith("Model (tiny): 1 layers, hidden 32"))
    assert "SwiGLU" not in model_line and "LayerNorm" in model_line  # tiny is GELU
    # the model line reads the shape's activation, and an older bench.json's swiglu flag
    for shape in ({"activation": "swiglu"}, {"swiglu": True}):
        swiglu = {**result, "meta": {**result["meta"], "shape": {**result["meta"]["shape"], **shape}}}
        assert " SwiGLU, LayerNorm" in report.markdown(swiglu)


def test_parity_with_the_baseline(bench_run):
    _, _, result = bench_run
    for p in result["sweep"]:
        assert p["parity_ok"] is True, p
        assert p["loss_max_rel_diff"] <= report.LOSS_RTOL
    base = {p["seq_length"]: p for p in result["sweep"] if p["config"] == "megatron-unfused"}
    for p in result["sweep"]:
        assert p["parity_reference"] == "megatron-unfused"
    ring = [p for p in result["sweep"] if p["config"] in NEW]
    for p in ring:  # same init and data: the first loss agrees to float32 rounding
        assert p["losses"][0] == pytest.approx(base[p["seq_length"]]["losses"][0], rel=1e-5)
        assert p["losses"][-1] < p["losses"][0]  # and it trains


def test_max_seq_section_budget_is_enforced(bench_run):
    _, _, result = bench_run
    ms = result["max_seq"]
    assert ms["budget_bytes"] == 24 * 2**20 and "enforced" in ms["enforcement"]
    base, plugin = ms["results"]["megatron-unfused"], ms["results"]["ring+all"]
    # The baseline's first probe died on the budget: nothing trainable.
    assert base["max_seq"] == 0 and not base["at_cap"]
    assert [(p["seq_length"], p["ok"], p["status"]) for p in base["probes"]] == [(1024, False, "over budget")]
    # The plugin trained every length up to the cap, each measured below the budget.
    assert plugin["max_seq"] == 2048 and plugin["at_cap"] is True
    assert [(p["seq_length"], p["ok"]) for p in plugin["probes"]] == [(1024, True), (2048, True)]
    assert all(0 < p["peak_mem_bytes"] <= ms["budget_bytes"] for p in plugin["probes"])
    assert ms["max_seq_ratio_vs_unfused"] is None  # no ratio against a baseline that trains nothing
    cp = ms["results"]["megatron-flash+cp"]
    if cp["max_seq"]:  # flash-class attention with CP fits too: it is the strongest baseline
        r = ms["max_seq_ratio_vs_strongest"]
        assert ms["strongest_baseline"] == "megatron-flash+cp" and ms["best_plugin"] == "ring+all"
        assert r["ratio"] == pytest.approx(plugin["max_seq"] / cp["max_seq"])
        assert r["baseline_max_seq"] == cp["max_seq"] and r["plugin_max_seq"] == 2048
    else:
        assert ms["max_seq_ratio_vs_strongest"] is None


def test_compare_exit_codes(bench_run, tmp_path, monkeypatch):
    """``--compare`` wiring of main(): the measured result against doctored previous results."""
    _, _, measured = bench_run
    monkeypatch.setattr(regression, "run", lambda args: json.loads(json.dumps(measured)))
    argv = ["--output-dir", str(tmp_path / "again"), "--no-plots", "--compare"]
    same = tmp_path / "same.json"
    same.write_text(json.dumps(measured))
    assert regression.main(argv + [str(same), "--tolerance", "5%"]) == 0
    previous = json.loads(json.dumps(measured))
    for p in previous["sweep"]:
        p["peak_mem_bytes"] = p["peak_mem_bytes"] // 2  # the previous run needed half: now "hungrier"
    hungry = tmp_path / "hungry.json"
    hungry.write_text(json.dumps(previous))
    assert regression.main(argv + [str(hungry), "--tolerance", "5%"]) == 1
    findings = json.loads((tmp_path / "again" / "bench.json").read_text())["regressions"]
    assert {f["kind"] for f in findings} == {"hungrier"} and len(findings) == len(measured["sweep"])
    assert regression.main(argv + [str(hungry), "--tolerance", "150%"]) == 0  # within a loose tolerance
    previous = json.loads(json.dumps(measured))
    previous["max_seq"]["results"]["ring+all"]["max_seq"] = 4096
    shrunk = tmp_path / "shrunk.json"
    shrunk.write_text(json.dumps(previous))
    assert regression.main(argv + [str(shrunk), "--tolerance", "5%"]) == 1
    previous["schema"] = "something-else/9"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(previous))
    with pytest.raises(ValueError, match="--compare"):
        regression.main(argv + [str(other)])


def test_bad_arguments_name_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--seq-lengths"):
        regression.main(TINY + ["--output-dir", str(tmp_path), "--seq-lengths", "66"])
    with pytest.raises(ValueError, match="--configs"):
        regression.main(TINY + ["--output-dir", str(tmp_path), "--configs", "nope"])
