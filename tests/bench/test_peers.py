"""The peers benchmark: a missing peer is a row with its reason; every case runs and checks against float64.

Timings are never asserted; the checks are on the rows' structure and the float64 errors.
"""

import sys

import pytest

from megatron_longctx.bench import peer_cases, peers


def _args(*extra):
    return peers.build_parser().parse_args(["--rounds", "1", "--attention-seqs", "512", "--kv-heads", "2",
                                            "--tiled-seqs", "512", "--hidden-size", "32", "--shards", "4", *extra])


def test_a_missing_peer_is_reported_unavailable_with_the_reason(monkeypatch):
    for name in [m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed -> ImportError
    for impl in ("deepspeed-ulysses", "alst-tiled-mlp", "alst-tiled-loss"):
        reason = peer_cases.peer_unavailable(impl)
        assert reason.startswith("deepspeed not importable (") and "Error" in reason and "[peers]" in reason
    assert peer_cases.peer_unavailable("ours-ring") is None
    rows = peers.measure_all([c for c in peers.case_list(_args("--only", "alst-tiled-mlp"))], 1, 60, log=lambda s: None)
    assert [(r["impl"], r["status"].split(":")[0]) for r in rows] == [("alst-tiled-mlp", "unavailable")]
    pairs = peers.pair_rows(rows)
    assert pairs == []  # ours was not measured: no pair
    table = peers.markdown({"rounds": 1, "rows": rows, "pairs": pairs})
    assert "unavailable: deepspeed not importable" in table


@pytest.mark.parametrize("impl", peer_cases.TILED_MLP + peer_cases.TILED_LOSS)
def test_tiled_cases_in_process_match_float64(impl):
    if peer_cases.peer_unavailable(impl):
        pytest.skip(peer_cases.peer_unavailable(impl))
    case = {"kind": "tiled", "impl": impl, "seq": 512, "hidden": 32, "ffn": 112, "vocab": 1024, "shards": 4, "seed": 5}
    out = peer_cases.tiled_rank(case)
    assert out["max_rel_err"] < 1e-5
    assert out["cpu_s"] > 0 and out["peak_added_bytes"] >= 0
    assert len(out["cpu_s_steps"]) == peer_cases.STEADY_STEPS and min(out["cpu_s_steps"]) > 0


def test_attention_and_torch_cp_rows_on_two_ranks(tmp_path):
    only = "ours-ring,ours-ulysses,deepspeed-ulysses,torch-context-parallel"
    rc = peers.main(["--out-dir", str(tmp_path), "--rounds", "1", "--attention-seqs", "512", "--kv-heads", "2",
                     "--tiled-seqs", "", "--only", only, "--interleaved-rounds", "3"])
    assert rc == 0
    import json

    result = json.loads((tmp_path / "peers.json").read_text())
    rows = {r["impl"]: r for r in result["rows"]}
    for impl in ("ours-ring", "ours-ulysses"):
        assert rows[impl]["status"] == "ok", rows[impl]
        assert rows[impl]["max_rel_err_vs_float64"] < 1e-5 and len(rows[impl]["peak_mib_per_rank_median"]) == 2
    ds = rows["deepspeed-ulysses"]
    if peer_cases.peer_unavailable("deepspeed-ulysses"):
        assert ds["status"].startswith("unavailable")
    else:
        assert ds["status"] == "ok" and ds["max_rel_err_vs_float64"] < 1e-5
        pair = {(p["ours"], p["peer"]): p for p in result["pairs"]}[("ours-ulysses", "deepspeed-ulysses")]
        assert pair["status"] == "ok" and pair["time_ratio"] > 0 and pair["mem_ratio"] > 0
        assert pair["time_ratio_steady"] == rows["ours-ulysses"]["cpu_s_steady_median"] / ds["cpu_s_steady_median"]
        assert pair["time_ratio_interleaved_rounds"] == 3 and pair["time_ratio_interleaved"] > 0
    for impl in ("ours-ring", "ours-ulysses"):  # interleaved in one pair of ranks, one call per round each
        assert len(rows[impl]["cpu_s_interleaved"]) == 3 and min(rows[impl]["cpu_s_interleaved"]) > 0
    assert "cpu_s_interleaved" not in rows["torch-context-parallel"]
    # torch's context_parallel on CPU: the row names exactly what fails (or says it ran)
    tcp = rows["torch-context-parallel"]["status"]
    assert tcp.startswith("ok") or ("fails on CPU" in tcp and "Error" in tcp)
    assert "| ours-ulysses / deepspeed-ulysses |" in (tmp_path / "peers.md").read_text()


def test_steady_time_is_the_slowest_rank_per_call_then_medians():
    case = {"kind": "attention", "impl": "ours-ring", "seq": 512}

    def rank(cpu, steps):
        return {"cpu_s": cpu, "cpu_s_steps": steps, "peak_added_bytes": 2.0**20, "max_rel_err": 0.0}

    runs = [[rank(1.0, [0.5, 0.9, 0.4]), rank(2.0, [0.6, 0.1, 0.3])],  # slowest per call: 0.6, 0.9, 0.4
            [rank(3.0, [0.2, 0.2, 0.2]), rank(1.0, [0.1, 0.1, 0.1])],  # 0.2, 0.2, 0.2
            [rank(1.5, [1.0, 2.0, 3.0]), rank(1.5, [0.0, 0.0, 0.0])]]  # 1.0, 2.0, 3.0
    row = peers._row(case, runs, None, "0")
    assert row["cpu_s"] == [2.0, 3.0, 1.5] and row["cpu_s_median"] == 2.0
    assert row["cpu_s_steady"] == [0.6, 0.2, 2.0] and row["cpu_s_steady_median"] == 0.6


def test_interleaved_ratio_is_the_median_of_per_round_ratios_with_quartiles_and_a_verdict():
    peer = [1.0, 2.0, 4.0, 1.0, 2.0]
    faster = peers.interleaved_ratio([0.9, 1.8, 3.2, 0.95, 1.7], peer)  # per round 0.9 0.9 0.8 0.95 0.85
    assert faster["time_ratio_interleaved"] == pytest.approx(0.9)
    assert faster["time_ratio_interleaved_quartiles"] == pytest.approx([0.85, 0.9])
    assert faster["time_ratio_interleaved_rounds"] == 5 and faster["time_ratio_interleaved_verdict"] == "faster"
    # medians of the raw times would say 1.8 / 2.0 = 0.9 too, but these rounds straddle 1.0: a tie
    tie = peers.interleaved_ratio([0.8, 2.4, 3.6, 1.1, 1.8], peer)  # 0.8 1.2 0.9 1.1 0.9
    assert tie["time_ratio_interleaved"] == pytest.approx(0.9) and tie["time_ratio_interleaved_verdict"] == "tie"
    slower = peers.interleaved_ratio([1.1, 2.4, 4.8, 1.3, 2.2], peer)  # 1.1 1.2 1.2 1.3 1.1
    assert slower["time_ratio_interleaved"] == pytest.approx(1.2) and slower["time_ratio_interleaved_verdict"] == "slower"
    assert peers.interleaved_ratio(None, peer) == {}
    failed = peers.interleaved_ratio("failed: RuntimeError: x", peer)
    assert failed == {"time_ratio_interleaved_status": "failed: RuntimeError: x"}
    row = {"ours": "ours-ring", "peer": "deepspeed-ulysses", "seq": 512, "hkv": 2, "status": "ok", "time_ratio": 1.0,
           "time_ratio_steady": 1.0, "mem_ratio": 1.0}
    table = peers.markdown({"rounds": 1, "interleaved_rounds": 5, "rows": [],
                            "pairs": [{**row, **faster}, {**row, **failed}]})
    assert "| 0.900 [0.850–0.900] faster |" in table and "| failed: RuntimeError: x |" in table


def test_a_failed_interleaved_timing_is_reported_on_each_row(monkeypatch):
    monkeypatch.setattr(peer_cases, "interleaved_rank", _interleaved_rank_one_raises)
    group = [{"kind": "attention", "impl": impl, "seq": 512} for impl in ("ours-ring", "ours-ulysses")]
    out = peers._interleaved(group, {"ours-ring": None, "ours-ulysses": None}, 3, timeout=600)
    status = "failed: ValueError: no ours-ring, ours-ulysses here"
    assert out == {"ours-ring": status, "ours-ulysses": status}
    assert peers._interleaved(group, {"ours-ring": None, "ours-ulysses": "not installed"}, 3, 600) == {}


def _interleaved_rank_one_raises(case):
    return _rank_one_raises({"impl": ", ".join(case["impls"])})


def _rank_one_raises(case):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(f"no {case['impl']} here")
    dist.barrier()  # never answered: rank 0 is stopped, not waited for
    return {}


def test_a_raising_rank_is_the_row_status_at_once():
    case = {"kind": "attention", "impl": "ours-ring", "seq": 512}
    runs = [peers.run_fresh(_rank_one_raises, case, 2, timeout=600)]
    assert runs[0][0]["status"] == "failed: stopped when rank 1 failed"
    assert runs[0][1]["status"] == "failed: ValueError: no ours-ring here" and "_rank_one_raises" in runs[0][1]["traceback"]
    row = peers._row(case, runs, None, "0")
    assert row["status"] == "failed: ValueError: no ours-ring here" and "ValueError" in row["traceback"]
