"""The benchmark's headline: the best plugin configuration's max trainable sequence over the strongest baseline.

Pure functions over the max-sequence results ``{name: {"max_seq", "at_cap", ...}}`` and the roles of the
configurations (``baseline`` or ``plugin``), so the selection is tested on synthetic records.
"""

from __future__ import annotations

from typing import Any, Optional

TARGET = 16  # ALST's factor over its baseline (arXiv:2506.13996)
MODEL_STATES_TARGET = 4  # model-state offload rows over the strongest baseline, on a model whose states fill the budget


def _best(results: dict[str, Any], names: list[str]) -> Optional[str]:
    """The name with the longest ``max_seq`` (ties: the earlier name); None when none trained at all."""
    best = None
    for name in names:
        r = results.get(name)
        if r is None or not r.get("max_seq"):
            continue
        if best is None or r["max_seq"] > results[best]["max_seq"]:
            best = name
    return best


def _ratio(results: dict[str, Any], plugin: str, baseline: str, target: float = TARGET) -> dict[str, Any]:
    p, b = results[plugin], results[baseline]
    ratio = p["max_seq"] / b["max_seq"]
    # at the cap, a length is a lower bound: a plugin at its cap bounds the ratio from below, a baseline
    # at its cap from above
    return {"plugin": plugin, "plugin_max_seq": p["max_seq"], "baseline": baseline, "baseline_max_seq": b["max_seq"],
            "ratio": ratio, "plugin_at_cap": bool(p.get("at_cap")), "baseline_at_cap": bool(b.get("at_cap")),
            "meets_target": ratio >= target, "target": target}


def max_seq_headline(results: dict[str, Any], roles: dict[str, str], reference: str) -> dict[str, Any]:
    """``max_seq_ratio_vs_strongest`` and ``max_seq_ratio_vs_<reference>`` for the best plugin configuration.

    ``roles``: configuration name -> ``"baseline"`` | ``"plugin"``.  The strongest baseline is the one with
    the longest max sequence.  A ratio is absent (``None``) when its plugin or baseline trained nothing.
    """
    plugins = [n for n in results if roles.get(n) == "plugin"]
    baselines = [n for n in results if roles.get(n) == "baseline"]
    best_plugin, strongest = _best(results, plugins), _best(results, baselines)
    out: dict[str, Any] = {"best_plugin": best_plugin, "strongest_baseline": strongest,
                           "max_seq_ratio_vs_strongest": None, "max_seq_ratio_vs_unfused": None}
    if best_plugin and strongest:
        out["max_seq_ratio_vs_strongest"] = _ratio(results, best_plugin, strongest)
    if best_plugin and results.get(reference, {}).get("max_seq"):
        out["max_seq_ratio_vs_unfused"] = _ratio(results, best_plugin, reference)
    return out


def _ratio_line(label: str, r: Optional[dict[str, Any]], headline: dict[str, Any], row: str,
                mark_cap: bool = False) -> str:
    """``<label>: <row> N / strongest baseline <name> M = Rx (target ...)``, or why there is no ratio."""
    if not r:
        return (f"{label}: no ratio ({row} {headline.get('best_plugin')}, strongest baseline "
                f"{headline.get('strongest_baseline')})")
    low = "≥ " if r["plugin_at_cap"] and not r["baseline_at_cap"] else ""
    cap = " (cap)" if mark_cap and r["plugin_at_cap"] else ""
    return (f"{label}: {r['plugin']} {r['plugin_max_seq']}{cap} / strongest baseline {r['baseline']} "
            f"{r['baseline_max_seq']} = {low}{r['ratio']:.1f}x (target >= {r['target']}x: "
            f"{'met' if r['meets_target'] else 'not met'})")


def headline_line(headline: dict[str, Any]) -> str:
    """One printable line: ``best / strongest = ratio`` with both lengths, and the unfused ratio labelled."""
    text = _ratio_line("max trainable sequence", headline.get("max_seq_ratio_vs_strongest"), headline, "best plugin")
    u = headline.get("max_seq_ratio_vs_unfused")
    if headline.get("max_seq_ratio_vs_strongest") and u:
        text += f"; vs {u['baseline']} (unfused attention) {u['baseline_max_seq']}: {u['ratio']:.1f}x"
    return text


def model_states_headline(results: dict[str, Any], roles: dict[str, str], streamed: set[str]) -> Optional[dict[str, Any]]:
    """The best model-state offload row (names in ``streamed``) over the strongest baseline, both searched
    under the same budget, which holds every row's weights, gradients and Adam moments; None when no
    model-state row was searched.  The other plugin rows are the main headline's (:func:`max_seq_headline`)."""
    rows = [n for n in results if n in streamed]
    if not rows:
        return None
    baselines = [n for n in results if roles.get(n) == "baseline"]
    best, strongest = _best(results, rows), _best(results, baselines)
    out: dict[str, Any] = {"best_plugin": best, "strongest_baseline": strongest, "ratio": None}
    if best and strongest:
        out["ratio"] = _ratio(results, best, strongest, MODEL_STATES_TARGET)
    return out


def model_states_line(headline: dict[str, Any]) -> str:
    """``max trainable sequence with model states counted: <row> N / strongest baseline <name> M = Rx``."""
    return _ratio_line("max trainable sequence with model states counted", headline.get("ratio"), headline,
                       "best model-state row", mark_cap=True)
