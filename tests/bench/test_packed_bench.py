"""The packed benchmark's rows: the pack's work equals its documents', one backend block call per document
on the CPU, and the dense row has the pack's number of visible pairs."""

import json

from megatron_longctx.bench import packed_bench


def test_packed_bench_rows(tmp_path, capsys):
    out = tmp_path / "packed.json"
    packed_bench.main(["--docs", "6", "--doc-len", "32", "--head-dim", "8", "--repeats", "1", "--json", str(out)])
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    packed, dense = rows["packed"], rows["dense, same pairs"]
    assert packed["pairs"] == 6 * 32 * 33 // 2 and packed["docs"] == 6 and packed["schedule_calls"] == 6
    assert packed["backend_calls"]["forward"] == packed["backend_calls"]["backward"] == 6  # one per document
    assert dense["docs"] == 1 and dense["backend_calls"]["forward"] == 1
    assert abs(dense["pairs"] - packed["pairs"]) <= dense["tokens"]  # the same work, to one row
    assert dense["packed_over_dense"] == 1.0 and packed["packed_over_dense"] > 0
    assert "ns/pair" in capsys.readouterr().out
