"""``megatron-longctx bench extension``: context extension measured end to end, as a user runs it.

    megatron-longctx bench extension [--short 1024] [--long 16384] [--pretrain-steps 2000] [--extend-steps 60] \\
        [--output-dir runs/extension] [Megatron flags for every phase, e.g. --hidden-size 128]

1. ``run``: a model pretrained at ``--short`` tokens (CP=1, the ranks data-parallel) on the byte corpus with
   ``--pretrain-passkeys`` passkey prompts in it (``--data-passkeys``: what retrieval is learned from);
2. ``eval`` of that checkpoint at ``--long`` under the plugin's CP: the per-position loss and passkey
   retrieval at ``--short``, ``--long``/4 and ``--long``;
3. ``extend``: one stage at ``--long`` from that checkpoint, a larger RoPE base (default: the NTK rule,
   ``base · (long/short)^(d/(d-2))``), passkey prompts up to ``--long`` in its corpus;
4. ``eval`` of the extended checkpoint, the same way.

``OUTPUT_DIR/extension.json`` holds both evaluations, every command, and each phase's wall time; the table
compares passkey retrieval per length (whole keys, and answer digits right: chance is 0.10) and the loss per
position bin beyond ``--short``, before and after.
Each phase's output goes to ``OUTPUT_DIR/<phase>.log``; a finished phase (its summary.json or eval.json
written) is not run again, and ``extend`` resumes its stage, so the same command continues after an interruption.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

from megatron_longctx.bench import harness

MODEL = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "512"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-longctx bench extension", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                epilog="Any other flag is Megatron-LM's and goes to every phase (after the "
                                       f"default model, {' '.join(MODEL)}).")
    p.add_argument("--output-dir", default="runs/extension")
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--short", type=int, default=1024, help="pretraining length (tokens)")
    p.add_argument("--long", type=int, default=16384, help="the extended length (tokens)")
    p.add_argument("--pretrain-steps", type=int, default=2000)
    p.add_argument("--pretrain-batch", type=int, default=8, help="global batch (sequences) when pretraining")
    p.add_argument("--pretrain-passkeys", type=int, default=3000, help="passkey prompts in the pretraining corpus")
    p.add_argument("--extend-steps", type=int, default=60)
    p.add_argument("--extend-batch", type=int, default=2, help="global batch (sequences) when extending")
    p.add_argument("--extend-passkeys", type=int, default=300, help="passkey prompts in the extension corpus")
    p.add_argument("--rotary-base", type=int, default=10000, help="RoPE base when pretraining")
    p.add_argument("--extend-rotary-base", type=int, default=None, help="RoPE base when extending (default: NTK)")
    p.add_argument("--data-max-bytes", type=int, default=1 << 20, help="bytes of stdlib sources in the corpus")
    p.add_argument("--passkey-trials", type=int, default=4, help="keys per length and depth in each evaluation")
    return p


def ntk_base(base: int, short: int, long: int, head_dim: int) -> int:
    """The RoPE base whose lowest frequency spans ``long`` as ``base``'s spanned ``short`` (NTK-aware scaling)."""
    return int(round(base * (long / short) ** (head_dim / (head_dim - 2))))


def _flag(argv: list[str], name: str, default: str) -> str:
    """The last value of ``name`` in ``argv``, else ``default``."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    return values[-1] if values else default


def phases(own: argparse.Namespace, megatron: list[str]) -> list[tuple[str, list[str], Optional[str]]]:
    """``(name, megatron-longctx arguments, the file whose presence says it finished)`` of each phase."""
    out = own.output_dir
    model = [*MODEL, *megatron]
    head_dim = int(_flag(model, "--hidden-size", "128")) // int(_flag(model, "--num-attention-heads", "4"))
    extended_base = own.extend_rotary_base or ntk_base(own.rotary_base, own.short, own.long, head_dim)
    data = ["--data-dir", os.path.join(out, "data"), "--data-max-bytes", str(own.data_max_bytes),
            "--nproc-per-node", str(own.nproc_per_node), "--no-progress"]
    pretrained = os.path.join(out, "pretrain", "checkpoint")
    extended = os.path.join(out, "extend", f"stage1-{own.long}", "checkpoint")
    lengths = ",".join(str(n) for n in sorted({own.short, own.long // 4, own.long}))

    def evaluate(name: str, load: str, base: int) -> tuple[str, list[str], str]:
        return (name, ["eval", *model, *data, "--load", load, "--rotary-base", str(base), "--seq-length",
                       str(own.long), "--max-position-embeddings", str(own.long), "--passkey-lengths", lengths,
                       "--passkey-trials", str(own.passkey_trials), "--output-dir", os.path.join(out, name)],
                os.path.join(out, name, "eval.json"))

    return [
        ("pretrain", ["run", *model, *data, "--seq-length", str(own.short), "--max-position-embeddings",
                      str(own.short), "--rotary-base", str(own.rotary_base), "--context-parallel-size", "1",
                      "--global-batch-size", str(own.pretrain_batch), "--train-iters", str(own.pretrain_steps),
                      "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", str(max(1, own.pretrain_steps // 30)),
                      "--data-passkeys", str(own.pretrain_passkeys), "--no-baseline", "--no-resume-check",
                      "--output-dir", os.path.join(out, "pretrain")],
         os.path.join(out, "pretrain", "summary.json")),
        evaluate("eval-before", pretrained, own.rotary_base),
        ("extend", ["extend", *model, *data, "--load", pretrained, "--stages", f"{own.long}:{own.extend_steps}",
                    "--rotary-base", str(extended_base), "--global-batch-size", str(own.extend_batch),
                    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", str(max(1, own.extend_steps // 10)),
                    "--data-passkeys", str(own.extend_passkeys), "--output-dir", os.path.join(out, "extend")],
         None),  # extend skips the stages it finished itself
        evaluate("eval-after", extended, extended_base),
    ]


def report(result: dict[str, Any], short: int) -> str:
    """Passkey accuracy per length and the loss per position bin, before and after extension."""
    before, after = result["eval-before"], result["eval-after"]
    lines = ["| passkey length | before: retrieved | after: retrieved | before: digits right | after: digits right |",
             "|---:|---:|---:|---:|---:|"]

    def mean(r: dict, key: str, i: int) -> float:
        return sum(r["passkey"][key][i]) / len(r["passkey"][key][i])

    for i, length in enumerate(before["passkey"]["lengths"]):
        lines.append(f"| {length} | {mean(before, 'accuracy', i):.2f} | {mean(after, 'accuracy', i):.2f} | "
                     f"{mean(before, 'digit_accuracy', i):.2f} | {mean(after, 'digit_accuracy', i):.2f} |")
    lines += ["", "| positions | before: loss | after: loss |", "|---|---:|---:|"]
    for b, a in zip(before["position_loss"]["bins"], after["position_loss"]["bins"]):
        mark = "" if b["start"] >= short else " (within the pretrained length)"
        lines.append(f"| {b['start']}-{b['end']}{mark} | {b['loss']:.4f} | {a['loss']:.4f} |")
    beyond = [(b["loss"], a["loss"], b["tokens"]) for b, a in zip(before["position_loss"]["bins"],
                                                                  after["position_loss"]["bins"]) if b["start"] >= short]
    if beyond:
        total = sum(t for _, _, t in beyond)
        lines.append(f"| beyond {short} (token-weighted) | {sum(b * t for b, _, t in beyond) / total:.4f} | "
                     f"{sum(a * t for _, a, t in beyond) / total:.4f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    own, megatron = build_parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if not own.short < own.long:
        print(f"megatron-longctx bench extension: --long {own.long} must exceed --short {own.short}", file=sys.stderr)
        return 2
    os.makedirs(own.output_dir, exist_ok=True)
    result: dict[str, Any] = {"meta": harness.environment(), "settings": vars(own), "megatron_flags": megatron,
                              "phases": {}}
    for name, args, marker in phases(own, megatron):
        command = [sys.executable, "-m", "megatron_longctx.cli", *args]
        record = {"command": "megatron-longctx " + " ".join(args)}
        if marker is not None and os.path.exists(marker):
            record["skipped"] = "finished before"
        else:
            print(f"[extension] {name}: {record['command']}", flush=True)
            start = time.perf_counter()
            with open(os.path.join(own.output_dir, f"{name}.log"), "w") as log:
                rc = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
            record.update(seconds=round(time.perf_counter() - start, 1), exit=rc)
            if rc != 0:
                print(f"megatron-longctx bench extension: {name} failed (exit {rc}); see "
                      f"{os.path.join(own.output_dir, name + '.log')}", file=sys.stderr)
                return rc
        result["phases"][name] = record
        if name.startswith("eval"):
            result[name] = json.load(open(marker))
    table = report(result, own.short)
    print(table)
    harness.write_json(os.path.join(own.output_dir, "extension.json"), result)
    with open(os.path.join(own.output_dir, "extension.md"), "w") as f:
        f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
