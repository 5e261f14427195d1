"""``megatron-longctx eval``'s table and plots from ``eval.json``."""

from __future__ import annotations

import os
from typing import Any


def table(result: dict[str, Any]) -> str:
    lines = [f"eval of {result['checkpoint']} (iteration {result['iteration']}) at {result['seq_length']} tokens, "
             f"{result['attention']} attention, CP={result['context_parallel_size']}, {result['world_size']} ranks",
             "", "position loss (nats/token)", f"{'positions':>17}  {'tokens':>8}  {'loss':>8}"]
    for b in result["position_loss"]["bins"]:
        lines.append(f"{b['start']:>8}-{b['end']:<8}  {b['tokens']:>8}  {b['loss']:>8.4f}")
    pk = result["passkey"]
    lines += ["", f"passkey retrieval ({pk['trials']} keys per cell): length x depth",
              f"{'length':>8}  " + "  ".join(f"{d:>6.2f}" for d in pk["depths"])]
    for length, row in zip(pk["lengths"], pk["accuracy"]):
        lines.append(f"{length:>8}  " + "  ".join(f"{a:>6.2f}" for a in row))
    lines += ["", f"answer digits right (of {pk['trials']} x 5 per cell; chance 0.10)"]
    for length, row in zip(pk["lengths"], pk["digit_accuracy"]):
        lines.append(f"{length:>8}  " + "  ".join(f"{a:>6.2f}" for a in row))
    if "peak_mem_bytes_per_rank" in result:
        peaks = "/".join(f"{p / 2**20:.0f}" for p in result["peak_mem_bytes_per_rank"])
        lines += ["", f"forward passes {result['seconds']:.0f} s; peak MiB per rank {peaks}"]
    return "\n".join(lines)


def plots(result: dict[str, Any], folder: str) -> list[str]:
    """``position_loss.png`` (the curve) and ``passkey.png`` (the heatmap); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = result["position_loss"]["bins"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([(b["start"] + b["end"]) / 2 for b in bins], [b["loss"] for b in bins], marker="o")
    ax.set_xlabel("position (tokens)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"loss by position at {result['seq_length']} tokens")
    curve = os.path.join(folder, "position_loss.png")
    fig.tight_layout()
    fig.savefig(curve, dpi=100)
    plt.close(fig)
    pk = result["passkey"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    image = ax.imshow(pk["accuracy"], vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(pk["depths"])), [f"{d:g}" for d in pk["depths"]])
    ax.set_yticks(range(len(pk["lengths"])), [str(n) for n in pk["lengths"]])
    ax.set_xlabel("needle depth")
    ax.set_ylabel("prompt length (tokens)")
    ax.set_title("passkey retrieval accuracy")
    fig.colorbar(image, ax=ax)
    heatmap = os.path.join(folder, "passkey.png")
    fig.tight_layout()
    fig.savefig(heatmap, dpi=100)
    plt.close(fig)
    return [curve, heatmap]
