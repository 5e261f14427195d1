"""The sink benchmark runs on the CPU at a tiny size and writes its rows (no timing is asserted)."""

import json

from megatron_longctx.bench import sinks_bench


def test_sinks_bench_writes_rows(tmp_path, capsys):
    path = tmp_path / "sinks.json"
    assert sinks_bench.main(["--seq", "64", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                             "--repeats", "1", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["seq"] for r in rows] == [64, 128]
    assert all(r["attention_s"] > 0 and r["with_sinks_s"] > 0 and r["sink_alone_s"] > 0 for r in rows)
    assert "sink share" in capsys.readouterr().out
