"""Max trainable sequence under an enforced per-rank memory budget: doubling, then bisection.

Every probe runs in a fresh measurement job (``torchrun``): the job warms up, measures its base memory
after the warm-up, trains the one length it was given, records the outcome and ends; :func:`drive` starts
the next job, which replays the known outcomes and probes the next length.  A probe's figure therefore
does not depend on which probes ran before it (a job that had trained longer sequences first would start
from a higher base and see less memory "added").  The budget is enforced by ending the job: on CPU a rank
dies as soon as its resident memory grows past the budget, on GPU an out-of-memory error ends it.  Before
its probe the job records which length it is attempting; when the job dies, :func:`drive` marks that
length as failed.  The search is deterministic in the outcomes: one job per probe.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable


def search_max_seq(probe: Callable[[int], bool], start: int, cap: int, granularity: int,
                   resolution: float) -> dict[str, Any]:
    """Longest sequence ``probe`` accepts: double from ``start`` until a failure or ``cap``, then bisect.

    ``probe(seq) -> bool`` (True = trained within the budget).  Lengths are multiples of ``granularity``;
    bisection stops when the gap is at most ``max(granularity, resolution · best)``.  Returns
    ``{"max_seq", "at_cap", "probes": [{"seq_length", "ok"}]}``; ``max_seq`` is 0 when ``start`` fails.
    """
    if start % granularity or start <= 0:
        raise ValueError(f"--max-seq-start {start} must be a positive multiple of {granularity}")
    probes: list[dict[str, Any]] = []

    def run(seq: int) -> bool:
        ok = bool(probe(seq))
        probes.append({"seq_length": seq, "ok": ok})
        return ok

    last_ok, first_fail, seq = 0, None, start
    while seq <= cap:
        if run(seq):
            last_ok, seq = seq, seq * 2
        else:
            first_fail = seq
            break
    if first_fail is None:
        return {"max_seq": last_ok, "at_cap": True, "probes": probes}
    while last_ok and first_fail - last_ok > max(granularity, resolution * last_ok):
        mid = (last_ok + first_fail) // 2 // granularity * granularity
        if mid <= last_ok:
            break
        if run(mid):
            last_ok = mid
        else:
            first_fail = mid
    return {"max_seq": last_ok, "at_cap": False, "probes": probes}


class _NextJob(Exception):
    """Raised inside a job's search when its one probe is done and another is needed."""


def run_in_job(search: dict[str, Any], measure: Callable[[int], dict[str, Any]], progress_path: str,
               is_writer: bool) -> dict[str, Any]:
    """The job side: replay ``search["known"]`` outcomes, measure the first unknown one in this process and
    end (``progress_path`` then says ``next``: :func:`drive` starts a fresh job for the next probe).

    ``measure(seq)`` returns the point record (``status == "ok"`` when it trained); a budget overrun ends
    the process inside ``measure``, after ``progress_path`` named the length being attempted.
    """
    known: dict[str, Any] = dict(search.get("known", {}))
    measured: list[int] = []

    def write(**extra: Any) -> None:
        if is_writer:
            tmp = progress_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"known": known, **extra}, f)
            os.replace(tmp, progress_path)

    def probe(seq: int) -> bool:
        if str(seq) in known:
            return known[str(seq)]["ok"]
        if measured:  # this job has trained one probe already: the next one gets a fresh process
            raise _NextJob
        measured.append(seq)
        write(attempting=seq)
        record = measure(seq)
        known[str(seq)] = {"ok": record.get("status") == "ok", "status": record.get("status"),
                           "peak_mem_bytes": record.get("peak_mem_bytes")}
        write()
        return known[str(seq)]["ok"]

    try:
        result = search_max_seq(probe, search["start"], search["cap"], search["granularity"], search["resolution"])
    except _NextJob:
        write(next=True)
        return {}
    for p in result["probes"]:
        p.update({k: v for k, v in known[str(p["seq_length"])].items() if k != "ok"})
    write(done=True, result=result)
    return result


def drive(launch: Callable[[dict[str, Any], str], tuple[int, str]], search: dict[str, Any], progress_path: str,
          budget_marker: str, log: Callable[[str], None], max_jobs: int = 64) -> dict[str, Any]:
    """The parent side: one fresh job per probe until one finishes the search; a job's death fails its
    attempted length.

    ``launch(search, progress_path) -> (exit code, output)`` runs one job.
    """
    search = dict(search, known=dict(search.get("known", {})))
    early_deaths = 0
    for _ in range(max_jobs):
        if os.path.exists(progress_path):
            os.remove(progress_path)
        rc, output = launch(search, progress_path)
        state: dict[str, Any] = {}
        if os.path.exists(progress_path):
            with open(progress_path) as f:
                state = json.load(f)
        search["known"].update(state.get("known", {}))
        if state.get("done"):
            return dict(state["result"], fresh_probes=True)
        if state.get("next"):  # its probe trained; the next one in a fresh job
            continue
        seq = state.get("attempting")
        if seq is None:  # died while starting up (no probe to blame): retry once, then give up
            early_deaths += 1
            if early_deaths > 1:
                raise RuntimeError(f"max-seq job exited {rc} before its first probe: {output[-1500:]}")
            log(f"    job exited {rc} before its first probe; starting it again")
            continue
        reason = "over budget" if budget_marker in output else f"failed (job exit {rc})"
        log(f"    {seq} tokens: {reason}")
        search["known"][str(seq)] = {"ok": False, "status": reason, "peak_mem_bytes": None}
    raise RuntimeError(f"max-seq search did not finish within {max_jobs} jobs")
