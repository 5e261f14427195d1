"""The benchmarks' shared environment record and JSON writer."""

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
