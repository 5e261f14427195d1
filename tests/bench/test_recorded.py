"""The recorded headline figures and their checks: ``bench --compare-recorded`` finds a fallen max sequence
or headline (synthetic results), and the gate trains the recorded configuration at the recorded length
and budget in one fresh probe job (a real torchrun job on 2 gloo ranks)."""

from __future__ import annotations

import time

from megatron_longctx.bench import recorded
from megatron_longctx.bench.compare import compare_recorded
from megatron_longctx.bench.configs import default_configs


def _result(max_seqs: dict, budget_mib: float, ratio: float, distributed_optimizer: bool = True) -> dict:
    return {"meta": {"distributed_optimizer": distributed_optimizer},
            "max_seq": {"budget_bytes": int(budget_mib * 2**20),
                        "results": {k: {"max_seq": v, "at_cap": False} for k, v in max_seqs.items()},
                        "max_seq_ratio_vs_strongest": {"ratio": ratio}}}


def test_the_recorded_figures_name_known_configurations_and_agree():
    figures = recorded.load()
    names = {c.name for c in default_configs(figures["nproc_per_node"])}
    assert set(figures["max_seq"]) <= names and figures["gate"]["config"] in names
    plugin, baseline = figures["headline"]["plugin"], figures["headline"]["baseline"]
    ratio = figures["max_seq"][plugin]["max_seq"] / figures["max_seq"][baseline]["max_seq"]
    assert abs(ratio - figures["headline"]["ratio"]) < 1e-6
    assert figures["gate"]["seq_length"] <= figures["max_seq"][figures["gate"]["config"]]["max_seq"]


def test_compare_recorded_finds_a_fallen_max_sequence_and_headline():
    figures = recorded.load()
    same = {k: v["max_seq"] for k, v in figures["max_seq"].items()}
    budget, ratio = figures["budget_mib"], figures["headline"]["ratio"]
    assert compare_recorded(_result(same, budget, ratio), figures, 0.05) == []
    plugin = figures["headline"]["plugin"]
    fallen = dict(same, **{plugin: int(same[plugin] * 0.7)})
    kinds = {(f.config, f.kind) for f in compare_recorded(_result(fallen, budget, ratio * 0.7), figures, 0.05)}
    assert kinds == {(plugin, "max_seq"), ("headline", "max_seq")}
    missing = {k: v for k, v in same.items() if k != plugin}
    assert {f.kind for f in compare_recorded(_result(missing, budget, ratio), figures, 0.05)} == {"missing"}
    other = compare_recorded(_result(same, budget / 2, ratio), figures, 0.05)
    assert [f.kind for f in other] == ["budget"] and "--budget-mib" in other[0].message
    assert figures["distributed_optimizer"] is True
    whole = compare_recorded(_result(same, budget, ratio, distributed_optimizer=False), figures, 0.05)
    assert [f.kind for f in whole] == ["optimizer"] and "without --no-distributed-optimizer" in whole[0].message


def test_the_best_configuration_still_fits_the_recorded_gate(tmp_path):
    gate = recorded.load()["gate"]
    start = time.perf_counter()
    result = recorded.gate_probe(gate, data_dir=str(tmp_path / "data"))
    probe = result["probes"][0]
    assert result["max_seq"] == gate["seq_length"], (
        f"{gate['config']} no longer trains {gate['seq_length']} tokens under {gate['budget_mib']} MiB/rank "
        f"in a fresh probe: {probe} ({time.perf_counter() - start:.0f} s)")
