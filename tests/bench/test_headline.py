"""The headline of the max-sequence search, on synthetic records: the strongest baseline and the ratios."""

import pytest

from megatron_longctx.bench.configs import REFERENCE, default_configs
from megatron_longctx.bench.headline import TARGET, headline_line, max_seq_headline

ROLES = {c.name: c.as_dict()["role"] for c in default_configs(2)}


def _results(**max_seqs):
    return {name.replace("_", "-"): {"max_seq": v, "at_cap": False, "probes": []} for name, v in max_seqs.items()}


def test_strongest_baseline_is_the_longest_one_not_the_unfused_one():
    results = {**_results(megatron_unfused=768), "megatron-flash": {"max_seq": 6144},
               "megatron-flash+recompute": {"max_seq": 10240}, "megatron-flash+cp": {"max_seq": 9216},
               "ring+all": {"max_seq": 24576}, "ulysses": {"max_seq": 12288}}
    h = max_seq_headline(results, ROLES, REFERENCE)
    assert h["best_plugin"] == "ring+all" and h["strongest_baseline"] == "megatron-flash+recompute"
    r = h["max_seq_ratio_vs_strongest"]
    assert (r["plugin"], r["plugin_max_seq"], r["baseline"], r["baseline_max_seq"]) == (
        "ring+all", 24576, "megatron-flash+recompute", 10240)
    assert r["ratio"] == pytest.approx(2.4) and r["meets_target"] is False and r["target"] == TARGET
    u = h["max_seq_ratio_vs_unfused"]
    assert u["baseline"] == REFERENCE and u["ratio"] == pytest.approx(32.0) and u["meets_target"] is True
    line = headline_line(h)
    assert "ring+all 24576 / strongest baseline megatron-flash+recompute 10240 = 2.4x" in line
    assert "not met" in line and "megatron-unfused (unfused attention) 768: 32.0x" in line


def test_ties_cap_and_nothing_trained():
    # equal lengths: the first configuration listed wins; a baseline that trained nothing is never the strongest
    results = {"megatron-unfused": {"max_seq": 0}, "megatron-flash": {"max_seq": 4096},
               "megatron-flash+cp": {"max_seq": 4096}, "ring+all": {"max_seq": 65536, "at_cap": True}}
    h = max_seq_headline(results, ROLES, REFERENCE)
    assert h["strongest_baseline"] == "megatron-flash"
    r = h["max_seq_ratio_vs_strongest"]
    assert r["ratio"] == 16 and r["meets_target"] is True and r["plugin_at_cap"] is True
    assert "= ≥ 16.0x" in headline_line(h)  # the plugin stopped at the cap: a lower bound
    assert h["max_seq_ratio_vs_unfused"] is None  # no ratio against a baseline that trained nothing
    none = max_seq_headline({"megatron-flash": {"max_seq": 0}, "ring+all": {"max_seq": 2048}}, ROLES, REFERENCE)
    assert none["strongest_baseline"] is None and none["max_seq_ratio_vs_strongest"] is None
    assert "no ratio" in headline_line(none)
    # a configuration of unknown role counts on neither side
    h = max_seq_headline({"megatron-flash": {"max_seq": 1024}, "mystery": {"max_seq": 10**6},
                          "ring+all": {"max_seq": 2048}}, ROLES, REFERENCE)
    assert h["best_plugin"] == "ring+all" and h["max_seq_ratio_vs_strongest"]["ratio"] == 2


def test_time_check_alternates_fresh_jobs_and_takes_medians(monkeypatch):
    from megatron_longctx.bench import regression

    order = []
    cost = {"ring+all": iter([120.0, 90.0, 100.0]), "megatron-flash+recompute": iter([100.0, 80.0, 70.0])}

    def fake_job(task, nproc, timeout):
        (name,) = task["configs"]
        order.append(name)
        assert task["seq_lengths"] == [4096] and task["warmup"] == 1
        return 0, "", [{"status": "ok", "cpu_us_per_token": next(cost[name])}]

    monkeypatch.setattr(regression, "run_probe_job", fake_job)
    args = regression.build_parser().parse_args(["--time-check-rounds", "3"])
    result = {"max_seq": {"best_plugin": "ring+all", "results": {"megatron-flash+recompute": {"max_seq": 4097}}}}
    case = regression._time_check_case(args, result, ["ring+all", "megatron-flash+recompute"])
    assert case == ("ring+all", "megatron-flash+recompute", 4096)  # rounded to a multiple of 2 x CP
    out = regression.time_check(args, {}, *case, log=lambda s: None)
    assert order == [
        "ring+all", "megatron-flash+recompute", "megatron-flash+recompute", "ring+all", "ring+all",
        "megatron-flash+recompute"]
    assert out["median_cpu_us_per_token"] == {"ring+all": 100.0, "megatron-flash+recompute": 80.0}
    assert out["ratio"] == pytest.approx(1.25) and out["meets_target"] is True
    assert regression._time_check_case(args, {}, ["ring+all"]) is None  # nothing to compare against
