"""The benchmarks' shared environment record, JSON writer and text table."""

import json
import platform

import torch

from megatron_longctx.bench import harness


def test_environment_records_versions_threads_machine_then_the_settings():
    meta = harness.environment(heads=4, dtype="float32")
    assert meta["torch"] == torch.__version__
    assert meta["python"] == platform.python_version()
    assert meta["machine"] == platform.machine()
    assert meta["threads"] == torch.get_num_threads()
    assert (meta["heads"], meta["dtype"]) == (4, "float32")


def test_write_json_makes_the_folder_and_round_trips(tmp_path, capsys):
    path = tmp_path / "new" / "deeper" / "out.json"
    payload = {"meta": harness.environment(), "rows": [{"seq": 8, "seconds": 0.5}]}
    harness.write_json(str(path), payload)
    assert json.loads(path.read_text()) == payload
    assert f"wrote {path}" in capsys.readouterr().out


def test_median_seconds_warms_up_once_then_times_each_repeat():
    calls = []
    seconds = harness.median_seconds(lambda: calls.append(1), 5)
    assert len(calls) == 6 and seconds >= 0.0
    calls.clear()
    harness.median_seconds(lambda: calls.append(1), 3, warm_up=False)
    assert len(calls) == 3


def test_table_aligns_text_left_and_numbers_right_each_column_as_wide_as_its_widest_cell():
    rows = [{"name": "ring", "seconds": 1.5, "calls": 12}, {"name": "allgather", "seconds": 10.25, "calls": 3}]
    out = harness.table([("algorithm", lambda r: r["name"], ""), ("s", lambda r: r["seconds"], ".2f"),
                         ("calls", lambda r: r["calls"], "d")], rows)
    assert out.splitlines() == ["algorithm     s calls",
                                "ring       1.50    12",
                                "allgather 10.25     3"]
    assert harness.table([("a", lambda r: r["a"], "d")], []) == "a"  # no rows: the header alone
