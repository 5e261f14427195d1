"""Mutation check: does the test suite fail when the package is wrong?

Each mutation below is one targeted change to the package source (a string replaced exactly once) and the
few tests that should catch it.  For every mutation the package and its tests are copied to a temporary
directory, the change is applied there (the working tree is never touched), and the named tests run with
``PYTHONPATH`` pointing at the copy.  A mutation is *caught* when the tests fail, *survived* when they pass;
``error`` means the tests could not run (a collection error, no test selected, a time-out).

    python scripts/mutation_check.py                  # every mutation: a table, bench-results/mutation_check.json
    python scripts/mutation_check.py -k zigzag -k merge --json out.json
    python scripts/mutation_check.py --baseline       # also run each selection unmutated first (must pass)
    python scripts/mutation_check.py --list

A tool to run and report (minutes on a laptop), not part of CI; ``tests/test_mutation_check.py`` only checks
that every mutation still applies to the source.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COPIED = ("megatron_longctx", "tests", "scripts", "pytest.ini", "setup.py")


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    find: str  # must occur exactly once in ``path``
    replace: str
    tests: tuple[str, ...]  # pytest arguments: files, node ids, ``-k`` expressions
    why: str = ""


MUTATIONS = [
    Mutation("zigzag-contiguous", "megatron_longctx/attention/zigzag.py",
             "    return rank, 2 * cp_size - 1 - rank", "    return 2 * rank, 2 * rank + 1",
             ("tests/attention/test_cp_attention.py", "-k", "shard or cp2-0-ring"),
             "rank r holds chunks 2r, 2r+1 instead of r, 2cp-1-r"),
    Mutation("merge-sign-flip", "megatron_longctx/kernels/merge.py",
             "w_b = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(lse))",
             "w_b = torch.where(finite, -torch.exp(lse_b - safe), torch.zeros_like(lse))",
             ("tests/kernels/test_merge.py",), "the incoming partial enters the online-softmax merge negated"),
    Mutation("tiled-loss-bf16-sum", "megatron_longctx/memory/tiled_loss.py",
             "sum_exp = logits.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)",
             "sum_exp = logits.sub_(row_max.unsqueeze(-1)).exp_().to(h.dtype).sum(dim=-1).to(logits.dtype)",
             ("tests/memory/test_tiled.py", "-k", "bf16"), "the sum of exponentials rounded to bf16 for bf16 inputs"),
    Mutation("window-left-edge", "megatron_longctx/kernels/base.py",
             "if self.left >= 0 and d_min > self.left:", "if self.left >= 0 and d_min >= self.left:",
             ("tests/kernels/test_masks.py",), "a block whose only visible pair sits on the left edge is skipped"),
    Mutation("window-right-edge", "megatron_longctx/kernels/base.py",
             "if self.right >= 0 and d_max < -self.right:", "if self.right >= 0 and d_max <= -self.right:",
             ("tests/kernels/test_masks.py",), "a block whose only visible pair sits on the right edge is skipped"),
    Mutation("ring-drops-last-offset", "megatron_longctx/attention/schedule.py",
             "        if t == 0 or any(step):",
             "        if t == 0 or (any(step) and (t < p - 1 or mask.left < 0)):",
             ("tests/attention/test_schedule.py",), "windowed ring schedules skip offset P-1"),
    Mutation("ring-drops-dkv-return", "megatron_longctx/attention/ring.py",
             "    own.add(0, k.shape[1], _received(incoming, k, v))  # every other rank's contribution",
             "    _received(incoming, k, v)",
             ("tests/attention/test_cp_attention.py", "-k", "cp2-0-ring or cp2-2-ring"),
             "the ring backward drops the dK/dV the other ranks sent home"),
    Mutation("allgather-drops-dkv-reduce", "megatron_longctx/attention/allgather.py",
             "        out.append(reduce_scatter(send, group).view(shape))",
             "        out.append(send[dist.get_rank(group)].clone().view(shape))",
             ("tests/attention/test_cp_attention.py", "-k", "cp2-10-allgather or cp2-12-allgather"),
             "all-gather CP keeps its own dK/dV share instead of reduce-scattering"),
    Mutation("gqa-head-map", "megatron_longctx/kernels/reference.py",
             "    return x.repeat_interleave(hq // x.shape[2], dim=2)",
             "    return x.repeat(1, 1, hq // x.shape[2], 1)",
             ("tests/kernels/test_reference.py",), "query head i reads K/V head i % h_kv instead of i // (h_q/h_kv)"),
    Mutation("ulysses-kv-replica-map", "megatron_longctx/attention/ulysses.py",
             "    return x if f == 1 else x.repeat_interleave(f, dim=2)",
             "    return x if f == 1 else x.repeat(1, 1, f, 1)",
             ("tests/attention/test_cp_attention.py", "-k", "cp4-21-ulysses or cp4-24-ulysses"),
             "K/V heads replicated for Ulysses in the wrong order (fewer K/V heads than ranks)"),
    Mutation("thd-document-end", "megatron_longctx/attention/layout.py",
             "Segment(start, min(length, n - start))", "Segment(start, min(length, n - start + 1))",
             ("tests/attention/test_packed_attention.py",), "a document's last segment takes one padding token"),
    Mutation("main-grad-not-accumulated", "megatron_longctx/memory/tiled_loss.py",
             "    if main is not None:\n        return main\n", "    if main is not None:\n        return main.zero_()\n",
             ("tests/memory/test_tiled.py", "-k", "main_grad"),
             "the tiled loss overwrites main_grad instead of adding to earlier micro-batches"),
    Mutation("offload-stale-shared-bytes", "megatron_longctx/memory/offload.py",
             "                or alive._version != version):", "                ):",
             ("tests/memory/test_offload.py", "tests/memory/test_tiled_recompute.py"),
             "an offloaded storage written in place since is restored from its stale copy"),
    Mutation("cpu-flash-dense-mask", "megatron_longctx/kernels/cpu_flash.py",
             "    lo, hi, s_q, s_k = piece.band_lo, piece.band_hi, piece.s_q, piece.s_k\n",
             "    lo, hi, s_q, s_k = piece.band_lo, piece.band_hi, piece.s_q, piece.s_k\n"
             "    return [(0, s_k, _Part.MASKED)]\n",
             ("tests/kernels/test_cpu_flash.py",), "every block, causal and full too, through a dense additive mask"),
    Mutation("window-served-whole", "megatron_longctx/kernels/driver.py",
             "    if live.band_lo is None or live.band_hi is None:\n        return None\n",
             "    return None\n",
             ("tests/attention/test_cp_memory.py", "-k", "window"),
             "a sliding window's block served as one masked piece (quadratic), not as row tiles of the band"),
    Mutation("varlen-one-call-per-block", "megatron_longctx/kernels/varlen.py",
             "    many = getattr(backend, \"forward_blocks\", None)\n",
             "    many = None\n",
             ("tests/kernels/test_varlen.py", "-k", "packed_ring"),
             "a packed ring step's blocks sent to the backend one call each, not as variable-length calls"),
]


def source_count(m: Mutation, root: str = ROOT) -> int:
    """How often ``m.find`` occurs in its file under ``root``."""
    with open(os.path.join(root, m.path)) as f:
        return f.read().count(m.find)


def _copy_tree(dst: str) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dst, name), ignore=ignore)
        elif os.path.exists(src):
            shutil.copy2(src, os.path.join(dst, name))


def _pytest(copy: str, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """Run ``tests`` in ``copy``: (outcome, seconds, tail of the output)."""
    env = dict(os.environ, PYTHONPATH=copy, PYTHONDONTWRITEBYTECODE="1")  # no stale bytecode across mutations
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", *tests]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "error (time-out)", time.monotonic() - start, ""
    seconds = time.monotonic() - start
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])
    outcome = {0: "passed", 1: "failed", 5: "error (no test selected)"}.get(proc.returncode,
                                                                          f"error (pytest exit {proc.returncode})")
    return outcome, seconds, tail


def run(mutations: list[Mutation], baseline: bool, timeout: float) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="mutation-check-") as copy:
        _copy_tree(copy)
        for m in mutations:
            row = {"mutation": m.name, "file": m.path, "tests": " ".join(m.tests), "why": m.why}
            path = os.path.join(copy, m.path)
            with open(path) as f:
                original = f.read()
            if original.count(m.find) != 1:
                rows.append({**row, "result": f"error (find occurs {original.count(m.find)} times)", "seconds": 0.0})
                continue
            if baseline:
                outcome, seconds, tail = _pytest(copy, m.tests, timeout)
                row.update(baseline=outcome, baseline_seconds=round(seconds, 1))
                if outcome != "passed":
                    rows.append({**row, "result": "error (fails unmutated)", "seconds": 0.0, "tail": tail})
                    _print_row(rows[-1])
                    continue
            with open(path, "w") as f:
                f.write(original.replace(m.find, m.replace))
            try:
                outcome, seconds, tail = _pytest(copy, m.tests, timeout)
            finally:
                with open(path, "w") as f:
                    f.write(original)
            result = {"failed": "caught", "passed": "survived"}.get(outcome, outcome)
            rows.append({**row, "result": result, "seconds": round(seconds, 1), "tail": tail})
            _print_row(rows[-1])
    return rows


def _print_row(row: dict) -> None:
    print(f"  {row['mutation']:<28} {row['result']:<10} {row['seconds']:>7.1f}s  {row['tests']}", flush=True)


def table(rows: list[dict]) -> str:
    lines = ["| mutation | tests | result | seconds |", "|---|---|---|---|"]
    lines += [f"| {r['mutation']} | `{r['tests']}` | {r['result']} | {r['seconds']:.1f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", dest="select", action="append", default=[],
                        help="run only mutations whose name contains this (repeatable)")
    parser.add_argument("--baseline", action="store_true", help="run each selection unmutated first; it must pass")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run (default 900)")
    parser.add_argument("--json", default="bench-results/mutation_check.json", help="where to write the results")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.select or any(s in m.name for s in args.select)]
    if args.list or not chosen:
        for m in MUTATIONS:
            print(f"{m.name:<28} {m.path:<44} {' '.join(m.tests)}")
        return 0 if chosen else 2
    start = time.monotonic()
    rows = run(chosen, args.baseline, args.timeout)
    total = time.monotonic() - start
    print(table(rows))
    caught = sum(r["result"] == "caught" for r in rows)
    print(f"{caught} of {len(rows)} caught in {total:.0f} s")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"schema": "mutation_check/1", "seconds": round(total, 1), "rows": rows}, f, indent=1)
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
