"""What limits the max trainable sequence: live tensor bytes per token at the step's peak, by what made them.

    python -m megatron_longctx.bench.live_memory --configs megatron-flash+cp+recompute,ring+all \
        --seq-lengths 2048,4096 --out runs/live_memory.json

Each configuration trains one step at each length (same probe job as the benchmark) under
:class:`LiveTensors`, a ``TorchDispatchMode`` that counts every storage an operator creates, labelled by
the module running it (``decoder.layers.2.mlp``; a recompute in backward is marked so) or else the
autograd node running it in backward (``backward:MmBackward0``), and freed when its last tensor dies.  At the step's peak of live bytes it
keeps the breakdown; the report is the growth of each label between the two lengths, per token of the
rank's local sequence.  Views share their storage (counted once); parameters, gradients kept from
before the step and optimizer state are outside the count (they do not grow with the sequence).
"""

from __future__ import annotations

import argparse
import collections
import sys
import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_longctx.bench import harness


class LiveTensors(TorchDispatchMode):
    """Live bytes of the storages operators create inside the block, and their breakdown at the peak."""

    def __init__(self, snapshot_step: float = 0.01) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.peak_by_label: dict[str, int] = {}  # taken at most ``snapshot_step`` (relative) below the peak
        self._snapshot_live = 0
        self._by_label: collections.Counter = collections.Counter()
        self._ptrs: dict[int, list] = {}  # data_ptr -> [nbytes, label, tensors alive]
        self._snapshot_step = snapshot_step
        self._modules: list[str] = []
        self._handles: list = []

    def _label(self, func: Any) -> str:
        op = func.__name__.split(".")[0]
        node = torch._C._current_autograd_node()
        if self._modules:  # forward, or a recompute inside backward
            return f"{self._modules[-1]}:{op}" + (" (in backward)" if node is not None else "")
        return f"backward:{node.name()}" if node is not None else f"(top):{op}"

    def _release(self, ptr: int) -> None:
        entry = self._ptrs.get(ptr)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] == 0:
            del self._ptrs[ptr]
            self.live -= entry[0]
            self._by_label[entry[1]] -= entry[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0:
                continue
            entry = self._ptrs.get(ptr)
            if entry is None:
                label = self._label(func)
                entry = self._ptrs[ptr] = [storage.nbytes(), label, 0]
                self.live += entry[0]
                self._by_label[label] += entry[0]
            entry[2] += 1
            weakref.finalize(t, self._release, ptr)
        if self.live > self.peak:
            self.peak = self.live
            if self.live > self._snapshot_live * (1 + self._snapshot_step):  # within a step of the true peak
                self._snapshot_live = self.live
                self.peak_by_label = {k: v for k, v in self._by_label.items() if v > 0}
        return out

    def watch(self, model: torch.nn.Module) -> None:
        """Label forward operators by the innermost running module of ``model``."""
        def enter(name: str) -> Any:
            def hook(*_: Any) -> None:
                self._modules.append(name)
            return hook

        def leave(*_: Any) -> None:  # returns None: a forward hook's return value would replace the output
            if self._modules:
                self._modules.pop()

        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(enter(name.replace("module.", "") or "(model)")))
            # always_call: a forward that raises (a tiled replay stops at its core attention) still leaves
            self._handles.append(module.register_forward_hook(leave, always_call=True))

    def unwatch(self) -> None:
        while self._handles:
            self._handles.pop().remove()


def _group(label: str) -> str:
    """``decoder.layers.2.mlp.linear_fc1:mm`` -> ``layer.mlp.linear_fc1:mm`` (layers summed)."""
    parts = label.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        return "layer." + ".".join(parts[3:]) if len(parts) > 3 else "layer:" + label.split(":", 1)[-1]
    return label


def per_token(records: list[dict[str, Any]], cp_of: dict[str, int]) -> dict[str, Any]:
    """Per local token growth by label between the shortest and the longest length of each configuration."""
    out: dict[str, Any] = {}
    by_config: dict[str, list] = collections.defaultdict(list)
    for r in records:
        if r.get("status") == "ok" and r.get("live_peak_by_label"):
            by_config[r["config"]].append(r)
    for name, recs in by_config.items():
        recs.sort(key=lambda r: r["seq_length"])
        lo, hi = recs[0], recs[-1]
        tokens = (hi["seq_length"] - lo["seq_length"]) // cp_of.get(name, 1)
        if tokens <= 0:
            continue
        grouped: collections.Counter = collections.Counter()
        for rec, sign in ((hi, 1), (lo, -1)):
            for label, n in rec["live_peak_by_label"].items():
                grouped[_group(label)] += sign * n
        out[name] = {"total_bytes_per_token": (hi["live_peak_bytes"] - lo["live_peak_bytes"]) / tokens,
                     "rss_bytes_per_token": (hi["peak_mem_bytes"] - lo["peak_mem_bytes"]) / tokens,
                     "by_label": dict(sorted(((k, v / tokens) for k, v in grouped.items() if abs(v) / tokens >= 8),
                                             key=lambda kv: -kv[1]))}
    return out


def top_labels(by_label: dict[str, int], top: int) -> dict[str, int]:
    """The ``top`` largest labels of one peak's breakdown (layers summed, :func:`_group`), bytes."""
    grouped: collections.Counter = collections.Counter()
    for label, n in by_label.items():
        grouped[_group(label)] += n
    return dict(grouped.most_common(top))


def main(argv: Optional[list[str]] = None) -> int:
    from megatron_longctx.bench import regression
    from megatron_longctx.bench.configs import default_configs

    p = argparse.ArgumentParser(prog="python -m megatron_longctx.bench.live_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="megatron-flash+cp+recompute,ring+all,allgather+all")
    p.add_argument("--seq-lengths", default="2048,4096")
    p.add_argument("--preset", default="llama-h256", choices=sorted(regression.PRESETS))
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (as the benchmark's --bf16)")
    p.add_argument("--out", default=None, help="JSON file to write")
    p.add_argument("--top", type=int, default=12, help="labels printed per configuration")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    bench_args = regression.build_parser().parse_args(["--preset", args.preset, "--nproc-per-node",
                                                       str(args.nproc_per_node)] + ["--bf16"] * args.bf16)
    shape = regression.model_shape(bench_args)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    seqs = [int(s) for s in args.seq_lengths.split(",")]
    task = regression.probe_task(bench_args, shape, "runs/live_memory_data", warmup=1, steps=1, configs=names,
                                 seq_lengths=seqs, trace_live=True)
    rc, output, records = regression.run_probe_job(task, args.nproc_per_node, 3600)
    if rc != 0 and not records:
        raise RuntimeError(f"live-memory job exited {rc}: {output[-1500:]}")
    cp_of = {c.name: c.variant.context_parallel_size for c in default_configs(args.nproc_per_node)}
    result = {"shape": shape, "seq_lengths": seqs, "per_token": per_token(records, cp_of),
              "records": [{**{k: v for k, v in r.items() if k in ("config", "seq_length", "status", "live_peak_bytes",
                                                                 "peak_mem_bytes")},
                           "top_at_peak": top_labels(r.get("live_peak_by_label", {}), args.top)} for r in records]}
    for r in result["records"]:
        if r["top_at_peak"]:
            print(f"{r['config']} at {r['seq_length']}: {r['live_peak_bytes'] / 2**20:.1f} MiB live at the peak")
            for label, b in r["top_at_peak"].items():
                print(f"    {b / 2**20:9.2f} MiB  {label}")
    for name, r in result["per_token"].items():
        print(f"{name}: {r['total_bytes_per_token']:.0f} B live / local token at the peak "
              f"(RSS: {r['rss_bytes_per_token']:.0f} B)")
        for label, b in list(r["by_label"].items())[:args.top]:
            print(f"    {b:9.0f}  {label}")
    if args.out:
        harness.write_json(args.out, {"meta": harness.environment(), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
