"""The window table of the kernel benchmark: every length under both masks, full causal capped."""

import json

from megatron_longctx.bench import kernels_bench


def test_window_table_rows_and_json(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels_bench, "FULL_CAUSAL_MAX", 512)
    out = tmp_path / "window_table.json"
    kernels_bench.main(["--window-table", "--window", "64", "--lengths", "256", "1024", "--repeats", "1",
                        "--json", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["tokens"], r["mask"]) for r in rows] == [(256, "full causal"), (256, "window (64, 0)"),
                                                        (1024, "window (64, 0)")]
    assert all(r["fwd_s"] > 0 and r["bwd_s"] > 0 and r["us_per_token"] > 0 for r in rows)
