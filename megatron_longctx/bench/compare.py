"""Regression check of one benchmark result against a previous one (``--compare previous.json``).

Speed is compared as each configuration's step-time *ratio to the baseline measured in the same run*
(absolute CPU times drift with machine load; the ratio does not), memory as peak bytes per rank, and
parity as the pass/fail verdict of the current run.  The max trainable sequence length of every
configuration must not shrink.  Every finding names the configuration, the sequence length and both
values, so a CI log says what regressed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

# the headline figures recorded in the repository (see :mod:`.recorded`)
RECORDED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "recorded.json")


def load_recorded(path: Optional[str] = None) -> dict[str, Any]:
    """The recorded figures (``recorded.json`` beside this module unless ``path``)."""
    with open(path or RECORDED_PATH) as f:
        return json.load(f)


@dataclasses.dataclass(frozen=True)
class Finding:
    config: str
    seq_length: int | None
    kind: str  # slower | hungrier | parity | max_seq | missing | budget | optimizer
    previous: float | None
    current: float | None
    message: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_tolerance(text: str) -> float:
    """``"5%"`` or ``"0.05"`` -> 0.05; raises ``ValueError`` naming ``--tolerance``."""
    raw = str(text).strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(f"--tolerance: cannot read {text!r}; give a percentage like 5% or a fraction like 0.05")
    if not 0 <= value < 10:
        raise ValueError(f"--tolerance: {text!r} is out of range; give e.g. 5% (0 <= tolerance < 1000%)")
    return value


def _points(result: dict[str, Any]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(p["config"], p["seq_length"]): p for p in result.get("sweep", []) if p.get("status") == "ok"}


def compare(current: dict[str, Any], previous: dict[str, Any], tolerance: float) -> list[Finding]:
    """Every way ``current`` is worse than ``previous`` beyond ``tolerance`` (a fraction, 0.05 = 5 %)."""
    findings: list[Finding] = []
    now, before = _points(current), _points(previous)
    for key, old in sorted(before.items()):
        config, seq = key
        new = now.get(key)
        if new is None:
            findings.append(Finding(config, seq, "missing", None, None,
                                    f"{config} @ {seq}: measured before, not measured (or failed) now"))
            continue
        old_t, new_t = old.get("time_ratio_vs_baseline"), new.get("time_ratio_vs_baseline")
        if old_t and new_t and new_t > old_t * (1 + tolerance):
            findings.append(Finding(config, seq, "slower", old_t, new_t,
                                    f"{config} @ {seq}: step time / baseline {old_t:.3f} -> {new_t:.3f} "
                                    f"(+{(new_t / old_t - 1) * 100:.1f}% > {tolerance * 100:.1f}%)"))
        old_m, new_m = old.get("peak_mem_bytes"), new.get("peak_mem_bytes")
        if old_m and new_m and new_m > old_m * (1 + tolerance):
            findings.append(Finding(config, seq, "hungrier", old_m, new_m,
                                    f"{config} @ {seq}: peak memory/rank {old_m / 2**20:.1f} -> {new_m / 2**20:.1f} MiB "
                                    f"(+{(new_m / old_m - 1) * 100:.1f}% > {tolerance * 100:.1f}%)"))
    for (config, seq), new in sorted(now.items()):
        if new.get("parity_ok") is False:
            findings.append(Finding(config, seq, "parity", None, new.get("loss_max_rel_diff"),
                                    f"{config} @ {seq}: loss/grad-norm parity with the baseline broke "
                                    f"(loss rel diff {new.get('loss_max_rel_diff')}, grad-norm rel diff "
                                    f"{new.get('grad_norm_max_rel_diff')})"))
    old_max = (previous.get("max_seq") or {}).get("results", {})
    new_max = (current.get("max_seq") or {}).get("results", {})
    for config, old in sorted(old_max.items()):
        o, n = old.get("max_seq"), (new_max.get(config) or {}).get("max_seq")
        if o and (n is None or n < o * (1 - tolerance)):
            findings.append(Finding(config, None, "max_seq", o, n,
                                    f"{config}: max trainable sequence under the budget {o} -> {n}"))
    return findings


def compare_recorded(current: dict[str, Any], recorded: dict[str, Any], tolerance: float) -> list[Finding]:
    """Every recorded max sequence (``recorded.json``: :mod:`.recorded`) that ``current`` no longer reaches
    beyond ``tolerance``, and the headline ratio when it fell; a run under another budget or optimizer is a
    finding too (its figures do not compare)."""
    findings: list[Finding] = []
    ms = current.get("max_seq") or {}
    budget = recorded.get("budget_mib")
    if ms and budget and abs(ms.get("budget_bytes", 0) / 2**20 - budget) > 1e-6:
        findings.append(Finding("*", None, "budget", budget, ms.get("budget_bytes", 0) / 2**20,
                                f"recorded figures are at {budget} MiB/rank, this run used "
                                f"{ms.get('budget_bytes', 0) / 2**20:.0f} MiB/rank: rerun with --budget-mib {budget}"))
        return findings
    want = bool(recorded.get("distributed_optimizer", False))
    if ms and bool((current.get("meta") or {}).get("distributed_optimizer", False)) != want:
        fix = "without --no-distributed-optimizer" if want else "with --no-distributed-optimizer"
        findings.append(Finding("*", None, "optimizer", want, not want,
                                f"recorded figures are {'with' if want else 'without'} Megatron's distributed "
                                f"optimizer, this run {'without' if want else 'with'} it: rerun {fix}"))
        return findings
    now = ms.get("results", {})
    for config, old in sorted(recorded.get("max_seq", {}).items()):
        o, n = old.get("max_seq"), (now.get(config) or {}).get("max_seq")
        if n is None:
            findings.append(Finding(config, None, "missing", o, None,
                                    f"{config}: recorded max sequence {o}, not searched now (--max-seq-configs)"))
        elif o and n < o * (1 - tolerance):
            findings.append(Finding(config, None, "max_seq", o, n,
                                    f"{config}: max trainable sequence {o} recorded -> {n} now"))
    old_r = (recorded.get("headline") or {}).get("ratio")
    new_r = (ms.get("max_seq_ratio_vs_strongest") or {}).get("ratio")
    if old_r and new_r is not None and new_r < old_r * (1 - tolerance):
        findings.append(Finding("headline", None, "max_seq", old_r, new_r,
                                f"headline ratio {old_r:.1f}x recorded -> {new_r:.1f}x now"))
    return findings
