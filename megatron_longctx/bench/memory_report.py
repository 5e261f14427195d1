"""Activation-memory report: saved bytes per token per layer, and peak memory, for each memory feature.

A small GPTModel (Megatron's local layer spec; causal PyTorch SDPA as core attention, so attention itself
stays O(s)) runs one forward+backward at each sequence length under: Megatron as is, Megatron's full recompute, and each of ours (checkpoint offload,
tiled MLP, tiled loss, all together).  Each run is its own process so that the peak resident set size
(CPU) or peak CUDA allocation (GPU) belongs to that run alone.  Prints a table, writes JSON.

    python -m megatron_longctx.bench.memory_report --seq 4096 16384 --out memory_report.json

Columns: ``layer B/tok/layer`` — bytes autograd keeps resident inside the transformer layers, per token
per layer; ``other B/tok`` — the rest (embedding, output layer, loss; Megatron's own full recompute keeps
the layer inputs at the block level, so they land here); ``saved B/tok`` — all resident saved bytes per
token; ``offloaded B/tok`` — bytes moved to host/disk; ``peak MiB`` — peak memory the step added over
what the process held before it (CUDA allocations on GPU, sampled RSS on CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch

from megatron_longctx.bench import harness
from megatron_longctx.memory.accounting import RSS_TRACKS_TENSORS_ENV

# name -> (Megatron TransformerConfig overrides, MemoryConfig fields)
CONFIGS: dict[str, tuple[dict, dict]] = {
    "megatron": ({}, {}),
    "megatron_full_recompute": (dict(recompute_granularity="full", recompute_method="uniform",
                                     recompute_num_layers=1), {}),
    "ours_full_recompute": ({}, dict(recompute_granularity="full")),
    "ours_checkpoint_offload": ({}, dict(recompute_granularity="full", offload_policy="checkpoint")),
    "ours_tiled_mlp": ({}, dict(tiled_mlp_tiles=8)),
    "ours_tiled_loss": ({}, dict(tiled_loss_tiles=8)),
    "ours_all": ({}, dict(recompute_granularity="full", offload_policy="checkpoint", tiled_mlp_tiles=8,
                          tiled_loss_tiles=8)),
}


def _init_single_process() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        with tempfile.NamedTemporaryFile(delete=False) as f:
            path = f.name
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=600))
    parallel_state.initialize_model_parallel()


class CausalSdpaAttention(torch.nn.Module):
    """A ``core_attention`` for this report: causal PyTorch SDPA (flash kernel on CPU and GPU), no mask tensor.

    Keeps attention at O(s) memory so that what the report compares, the activations the memory
    features act on, is not hidden under an ``[s, s]`` score or mask tensor.
    """

    def __init__(self, config: Any, layer_number: int = 1, attn_mask_type: Any = None, **_: Any) -> None:
        super().__init__()
        self.config = config

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                **_: Any) -> torch.Tensor:
        groups = query.shape[2] // key.shape[2]
        # [s, b, n, d] -> [b, n, s, d]; GQA groups expanded
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, n, s, d]
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)  # [s, b, n*d]


def _spec() -> Any:
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = get_gpt_layer_local_spec()
    attention = spec.submodules.self_attention
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules,
                                                  core_attention=ModuleSpec(module=CausalSdpaAttention)))))


def _build(megatron_overrides: dict, args: argparse.Namespace) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        ffn_hidden_size=4 * args.hidden, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, **megatron_overrides,
    )
    model = GPTModel(cfg, _spec(), vocab_size=args.vocab,
                     max_sequence_length=max(args.seq), position_embedding_type="rope")
    return model.to(args.device)


def run_one(name: str, seq: int, args: argparse.Namespace) -> dict:
    """One configuration at one sequence length, in this process; returns the measurements."""
    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.megatron.memory_spec import install
    from megatron_longctx.memory import MemoryConfig
    from megatron_longctx.memory.accounting import PeakMemory, SavedTensorAccountant

    megatron_overrides, memory_fields = CONFIGS[name]
    if memory_fields.get("offload_policy"):
        memory_fields = dict(memory_fields, offload_target=args.offload_target)
    with cpu_compat.enabled():
        _init_single_process()
        model = _build(megatron_overrides, args)
        handle = install(model, MemoryConfig(**memory_fields)) if memory_fields else None
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, args.vocab, (args.batch, seq), generator=g).to(args.device)
        position_ids = torch.arange(seq, device=args.device).expand(args.batch, seq)
        with PeakMemory(torch.device(args.device)) as peak:
            with SavedTensorAccountant(model) as acc:
                loss = model(tokens, position_ids, None, labels=tokens).float().mean()
            loss.backward()
        stats = handle.offloader.stats if handle is not None and handle.offloader is not None else None
        if handle is not None:
            handle.remove()
    n_tok = args.batch * seq
    per_layer = acc.saved.per_layer()
    layer_bytes = sum(v for k, v in per_layer.items() if k is not None)
    return {
        "config": name, "seq": seq, "batch": args.batch, "hidden": args.hidden, "layers": args.layers,
        "vocab": args.vocab, "device": args.device,
        "layer_bytes_per_token_per_layer": layer_bytes / n_tok / args.layers,
        "other_bytes_per_token": per_layer.get(None, 0) / n_tok,
        "offloaded_bytes_per_token": acc.saved.offloaded_total / n_tok,
        "peak_added_mib": peak.added_bytes / 2**20,
        "offload_stats": vars(stats) if stats is not None else None,
        "loss": loss.item(),
    }


def _child(name: str, seq: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "megatron_longctx.bench.memory_report", "--one", name, "--seq", str(seq),
           "--hidden", str(args.hidden), "--heads", str(args.heads), "--layers", str(args.layers),
           "--vocab", str(args.vocab), "--batch", str(args.batch), "--device", args.device,
           "--offload-target", args.offload_target]
    # The sampled RSS peak follows live memory instead of the heap's high-water mark.
    env = dict(os.environ, PYTHONWARNINGS="ignore", **RSS_TRACKS_TENSORS_ENV)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"config": name, "seq": seq, "error": (out.stderr or out.stdout)[-2000:]}
    return json.loads(lines[-1])


def _table(rows: list[dict]) -> str:
    head = (f"{'config':<26}{'seq':>7}{'layer B/tok/layer':>19}{'other B/tok':>13}{'saved B/tok':>13}"
            f"{'offloaded B/tok':>17}{'peak MiB':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['config']:<26}{r['seq']:>7}  ERROR {r['error'].strip().splitlines()[-1][:80]}")
            continue
        saved = r["layer_bytes_per_token_per_layer"] * r["layers"] + r["other_bytes_per_token"]
        lines.append(f"{r['config']:<26}{r['seq']:>7}{r['layer_bytes_per_token_per_layer']:>19.1f}"
                     f"{r['other_bytes_per_token']:>13.1f}{saved:>13.1f}{r['offloaded_bytes_per_token']:>17.1f}"
                     f"{r['peak_added_mib']:>10.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--offload-target", default=None, choices=["host", "disk"],
                        help="default: host on GPU, disk on CPU (host offload cannot lower CPU memory)")
    parser.add_argument("--out", default="memory_report.json")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.offload_target is None:
        args.offload_target = "host" if args.device == "cuda" else "disk"
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.seq[0], args)), flush=True)
        return 0
    rows = []
    for seq in args.seq:
        for name in args.configs:
            rows.append(_child(name, seq, args))
            print(_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(_table(rows))
    print()
    harness.write_json(args.out, {"meta": harness.environment(), "rows": rows,
                                  "args": {k: v for k, v in vars(args).items() if k != "one"}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
