"""The regression comparator, parity annotation, tolerance parsing and max-sequence search, on synthetic data."""

import copy

import pytest

from megatron_longctx.bench import compare, report
from megatron_longctx.bench.configs import REFERENCE as BASELINE, default_configs, select, unavailable_reason
from megatron_longctx.bench.regression import search_max_seq


def _point(config, seq, step_time, mem, losses, grad_norms):
    return {"config": config, "seq_length": seq, "status": "ok", "step_time_s": step_time, "peak_mem_bytes": mem,
            "losses": losses, "grad_norms": grad_norms}


def _result(ring_time=1.0, ring_mem=100 << 20, ring_losses=(5.0, 4.5), max_seq=16384):
    sweep = [
        _point(BASELINE, 1024, 2.0, 400 << 20, [5.0, 4.5], [2.0, 1.5]),
        _point("ring", 1024, ring_time, ring_mem, list(ring_losses), [2.0, 1.5]),
    ]
    report.annotate(sweep, BASELINE)
    return {"schema": report.SCHEMA, "sweep": sweep,
            "max_seq": {"results": {BASELINE: {"max_seq": 1024}, "ring": {"max_seq": max_seq}}}}


def test_annotate_ratios_and_parity():
    result = _result()
    ring = result["sweep"][1]
    assert ring["time_ratio_vs_baseline"] == pytest.approx(0.5)
    assert ring["mem_ratio_vs_baseline"] == pytest.approx(0.25)
    assert ring["loss_max_rel_diff"] == 0.0 and ring["parity_ok"] is True
    broken = _result(ring_losses=(5.0, 4.6))["sweep"][1]
    assert broken["loss_max_rel_diff"] == pytest.approx(0.1 / 4.5)
    assert broken["parity_ok"] is False


def test_same_result_has_no_regression():
    assert compare.compare(_result(), _result(), 0.05) == []


def test_within_tolerance_is_not_a_regression():
    assert compare.compare(_result(ring_time=1.04, ring_mem=104 << 20), _result(), 0.05) == []


@pytest.mark.parametrize("current, kind", [
    (_result(ring_time=1.2), "slower"),
    (_result(ring_mem=130 << 20), "hungrier"),
    (_result(ring_losses=(5.0, 4.7)), "parity"),
    (_result(max_seq=8192), "max_seq"),
])
def test_each_regression_is_found(current, kind):
    findings = compare.compare(current, _result(), 0.05)
    assert [f.kind for f in findings] == [kind]
    assert "ring" in findings[0].message


def test_a_point_that_no_longer_runs_is_a_regression():
    current = _result()
    current["sweep"][1] = {"config": "ring", "seq_length": 1024, "status": "failed: boom"}
    findings = compare.compare(current, _result(), 0.05)
    assert [f.kind for f in findings] == ["missing"]


def test_speed_is_compared_relative_to_the_baseline_of_the_same_run():
    # The whole machine got 2x slower: baseline and plugin alike -> no regression.
    slow = copy.deepcopy(_result())
    for p in slow["sweep"]:
        p["step_time_s"] *= 2
    report.annotate(slow["sweep"], BASELINE)
    assert compare.compare(slow, _result(), 0.05) == []


@pytest.mark.parametrize("text, value", [("5%", 0.05), ("0.1", 0.1), ("12.5%", 0.125)])
def test_parse_tolerance(text, value):
    assert compare.parse_tolerance(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["five", "-1%", "5000%"])
def test_bad_tolerance_names_the_flag(text):
    with pytest.raises(ValueError, match="--tolerance"):
        compare.parse_tolerance(text)


def test_search_finds_the_boundary_within_the_resolution():
    limit = 5000
    out = search_max_seq(lambda s: s <= limit, start=512, cap=65536, granularity=256, resolution=0.05)
    assert not out["at_cap"]
    assert out["max_seq"] <= limit and out["max_seq"] >= limit * 0.95 - 256
    assert all(p["ok"] == (p["seq_length"] <= limit) for p in out["probes"])
    assert [p["seq_length"] for p in out["probes"]][:5] == [512, 1024, 2048, 4096, 8192]


def test_search_at_cap_and_when_nothing_fits():
    capped = search_max_seq(lambda s: True, start=512, cap=4096, granularity=256, resolution=0.1)
    assert capped == {"max_seq": 4096, "at_cap": True, "probes": [{"seq_length": s, "ok": True}
                                                                   for s in (512, 1024, 2048, 4096)]}
    nothing = search_max_seq(lambda s: False, start=512, cap=4096, granularity=256, resolution=0.1)
    assert nothing["max_seq"] == 0 and len(nothing["probes"]) == 1


def test_search_rejects_a_bad_start():
    with pytest.raises(ValueError, match="--max-seq-start"):
        search_max_seq(lambda s: True, start=300, cap=4096, granularity=256, resolution=0.1)


def by_name_of(configs):
    return {c.name: c for c in configs}


def test_config_selection_and_availability():
    configs = default_configs(2)
    names = [c.name for c in configs]
    assert names[0] == BASELINE and {"megatron-flash", "megatron-flash+recompute", "megatron-flash+cp",
                                     "megatron-flash+cp+recompute", "allgather", "ulysses", "hybrid",
                                     "ring+offload", "ring+tiled", "ring+all"} <= set(names)
    roles = {c.name: c.as_dict()["role"] for c in configs}
    assert {n for n, r in roles.items() if r == "baseline"} == {
        BASELINE, "megatron-flash", "megatron-flash+recompute", "megatron-flash+cp", "megatron-flash+cp+recompute"}
    flash = by_name_of(configs)["megatron-flash"].variant
    assert flash.plugin and flash.context_parallel_size == 1 and not flash.megatron_recompute
    # every plugin memory feature off but the norm that stands in for TE's fused one
    assert dict(flash.longctx_options) == {"cp_algorithm": "ring", "lean_norm": True}
    assert all(dict(c.variant.longctx_options).get("lean_norm") for c in configs if c.variant.plugin)
    assert by_name_of(configs)["megatron-flash+cp"].variant.context_parallel_size == 2
    assert [c.name for c in select(configs, ["ring+all"])] == [BASELINE, "ring+all"]
    with pytest.raises(ValueError, match="--configs"):
        select(configs, ["warp-drive"])
    by_name = {c.name: c for c in configs}
    assert unavailable_reason(by_name[BASELINE], 2, 2) is None
    assert "CP >= 4" in unavailable_reason(by_name["hybrid"], 2, 2)
    assert "--num-query-groups" in unavailable_reason(by_name["ulysses"], 2, 1)


@pytest.mark.parametrize("argv, flag", [
    (["--nproc-per-node", "0"], "--nproc-per-node"),
    (["--steps", "0"], "--steps"),
    (["--budget-mib", "-1"], "--budget-mib"),
    (["--max-seq-resolution", "1.5"], "--max-seq-resolution"),
    (["--max-seq-start", "4096", "--max-seq-cap", "1024"], "--max-seq-cap"),
    (["--seq-lengths", "1024,abc"], "--seq-lengths"),
    (["--seq-lengths", "0"], "--seq-lengths"),
    (["--hidden-size", "0"], "--hidden-size"),
    (["--timeout", "0"], "--timeout"),
])
def test_bench_numeric_flags_are_checked(argv, flag, capsys):
    from megatron_longctx.bench import regression

    with pytest.raises(SystemExit) as exc:
        regression.main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("tokens, layer_tiles, mlp_tiles, loss_tiles", [
    (384, 0, 0, 0),  # a short sequence: fewer than 4 tiles' worth of each, nothing tiled
    (640, 0, 0, 5),  # the loss tiles from 512 tokens per rank on, the MLP and the layers from 1024
    (768, 0, 0, 6),  # below 4 layer tiles' worth: plain full recompute
    (1024, 4, 2, 8),  # 4 replayed tiles of 256; the MLP tiles each replayed tile
    (2048, 8, 2, 16),
    (14336, 56, 2, 112),
])
def test_tile_counts_follow_the_sequence(tokens, layer_tiles, mlp_tiles, loss_tiles):
    from megatron_longctx.bench.configs import tiles_for

    variant = by_name_of(default_configs(2))["allgather+all"].variant
    options = dict(tiles_for(variant, tokens).longctx_options)
    assert (options["recompute_tiles"], options["tiled_mlp_tiles"], options["tiled_loss_tiles"]) == (
        layer_tiles, mlp_tiles, loss_tiles)
    assert options.get("tiled_loss_recompute", False) == bool(loss_tiles)  # only with the tiled loss on
    ring = dict(tiles_for(by_name_of(default_configs(2))["ring+all"].variant, tokens).longctx_options)
    assert "recompute_tiles" not in ring and ring["tiled_mlp_tiles"] == (tokens // 256 if tokens >= 1024 else 0)
