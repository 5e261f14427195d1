"""The max-sequence search across jobs that die on a budget overrun (simulated jobs, no processes)."""

import pytest

from megatron_longctx.bench.maxseq import drive, run_in_job, search_max_seq

MARKER = "[memory budget]"


class _Died(Exception):
    pass


def _fake_jobs(limit, peak_per_token=10):
    """A launcher whose job trains in-process until a length over ``limit`` 'kills' it."""
    jobs, measured = [], []

    def measure(seq):
        measured.append((len(jobs), seq))
        if seq > limit:
            raise _Died()
        return {"status": "ok", "peak_mem_bytes": seq * peak_per_token}

    def launch(search, progress_path):
        jobs.append(dict(search["known"]))
        try:
            run_in_job(search, measure, progress_path, is_writer=True)
        except _Died:
            return 1, f"... {MARKER} rank 0: 70 MiB > budget 64 MiB"
        return 0, ""

    launch.measured = measured
    return launch, jobs


def test_drive_matches_the_single_process_search(tmp_path):
    launch, jobs = _fake_jobs(limit=5000)
    search = {"start": 512, "cap": 65536, "granularity": 256, "resolution": 0.05}
    result = drive(launch, search, str(tmp_path / "progress.json"), MARKER, log=lambda s: None)
    reference = search_max_seq(lambda s: s <= 5000, 512, 65536, 256, 0.05)
    assert result["max_seq"] == reference["max_seq"] and not result["at_cap"]
    assert [(p["seq_length"], p["ok"]) for p in result["probes"]] == \
        [(p["seq_length"], p["ok"]) for p in reference["probes"]]
    failures = [p for p in result["probes"] if not p["ok"]]
    assert len(jobs) == len(result["probes"])  # every probe in a fresh job, so no probe sees another's base
    assert [job for job, _ in launch.measured] == list(range(1, len(jobs) + 1))  # one probe per job
    assert [seq for _, seq in launch.measured] == [p["seq_length"] for p in result["probes"]]
    assert result["fresh_probes"]
    assert all(p["status"] == "over budget" for p in failures)
    assert all(p["peak_mem_bytes"] == p["seq_length"] * 10 for p in result["probes"] if p["ok"])


def test_drive_reports_a_job_that_dies_before_probing(tmp_path):
    calls = []

    def launch(search, progress_path):
        calls.append(1)
        return 1, "ImportError: no module named megatron"

    with pytest.raises(RuntimeError, match="before its first probe"):
        drive(launch, {"start": 512, "cap": 1024, "granularity": 256, "resolution": 0.1},
              str(tmp_path / "p.json"), MARKER, log=lambda s: None)
    assert len(calls) == 2  # one retry: a start-up death may be transient


def test_drive_retries_one_transient_start_up_death(tmp_path):
    good, _ = _fake_jobs(limit=10**9)
    calls = []

    def launch(search, progress_path):
        calls.append(1)
        return (1, "rendezvous timed out") if len(calls) == 1 else good(search, progress_path)

    result = drive(launch, {"start": 512, "cap": 1024, "granularity": 256, "resolution": 0.1},
                   str(tmp_path / "p.json"), MARKER, log=lambda s: None)
    assert result["max_seq"] == 1024 and result["at_cap"] and len(calls) == 3  # the death, then one job per probe


def test_non_budget_failure_is_labelled(tmp_path):
    def launch(search, progress_path):
        def measure(seq):
            if seq > 1024:
                raise _Died()
            return {"status": "ok", "peak_mem_bytes": 1}

        try:
            run_in_job(search, measure, progress_path, is_writer=True)
        except _Died:
            return 1, "Segmentation fault"
        return 0, ""

    result = drive(launch, {"start": 512, "cap": 4096, "granularity": 256, "resolution": 0.5},
                   str(tmp_path / "p.json"), MARKER, log=lambda s: None)
    assert result["max_seq"] == 1024
    assert [p["status"] for p in result["probes"] if not p["ok"]] == ["failed (job exit 1)"] * 2  # 2048, 1536
