"""``megatron-longctx plan``: which configuration fits, how fast it runs, and the flags for it.

    megatron-longctx plan --model llama3-8b --seq-length 1048576 --num-gpus 8 --gpu h200
    megatron-longctx plan --model custom --num-layers 4 --hidden-size 1024 ... --gpu-memory-gib 80 ...

Prints the chosen layout, the predicted memory per GPU by part, the predicted step time by part and
the Megatron-LM + ``--longctx-*`` flags; ``--json PATH`` also writes them.  Exit status 2 with a
message naming what to change when nothing fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from typing import Optional

from . import presets
from .model import GIB, ModelShape
from .recommend import CP_COMM_TYPES, Constraints, Plan, PlanInfeasible, describe, recommend
from .timing import Hardware, ring_overlap_tokens

_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                 "ffn_hidden_size", "vocab_size", "num_experts", "moe_router_topk", "moe_ffn_hidden_size")
_GPU_FIELDS = {"gpu_memory_gib": "memory_gib", "bf16_tflops": "bf16_tflops", "nvlink_gbps": "intra_node_gbps",
               "network_gbps": "inter_node_gbps", "host_link_gbps": "host_gbps", "gpus_per_node": "gpus_per_node",
               "host_memory_gib_per_gpu": "host_memory_gib_per_gpu"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-longctx plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--model", default="llama3-8b", help=f"preset ({', '.join(presets.MODELS)}) or 'custom'")
    p.add_argument("--seq-length", type=_tokens, required=True, help="tokens per sequence (e.g. 131072, 128K, 1M)")
    p.add_argument("--num-gpus", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, default=1)
    g = p.add_argument_group("model shape (overrides the preset; all required with --model custom)")
    for name in _SHAPE_FIELDS:
        g.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    g.add_argument("--activation", choices=("swiglu", "gelu"), default=None)
    h = p.add_argument_group("hardware (overrides the --gpu preset)")
    h.add_argument("--gpu", default="h200", help=f"preset: {', '.join(presets.GPUS)}")
    for flag in _GPU_FIELDS:
        h.add_argument("--" + flag.replace("_", "-"), type=float, default=None)
    c = p.add_argument_group("fix a choice instead of searching it")
    c.add_argument("--tp", type=int, default=None)
    c.add_argument("--cp", type=int, default=None)
    c.add_argument("--cp-comm-type", choices=CP_COMM_TYPES, default=None)
    c.add_argument("--recompute", choices=("none", "full"), default=None)
    c.add_argument("--offload", choices=("none", "checkpoint", "layers"), default=None)
    c.add_argument("--tiled-mlp-tiles", type=int, default=None)
    c.add_argument("--tiled-loss-tiles", type=int, default=None)
    c.add_argument("--optimizer-offload", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--json", default=None, help="also write the plan as JSON to this path")
    return p


def _tokens(text: str) -> int:
    """``131072``, ``128K``/``128k`` (×1024), ``1M`` (×1024²)."""
    t = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if scale > 1 else t) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seq-length {text!r}: give tokens as an integer, or with K/M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--seq-length {text!r}: must be positive")
    return value


def model_from_args(args: argparse.Namespace) -> ModelShape:
    overrides = {n: getattr(args, n) for n in _SHAPE_FIELDS if getattr(args, n) is not None}
    if args.activation is not None:
        overrides["activation"] = args.activation
    if args.model == "custom":
        missing = [n for n in _SHAPE_FIELDS[:7] if n not in overrides and n != "num_query_groups"]
        if missing:
            raise ValueError("--model custom needs " + ", ".join("--" + n.replace("_", "-") for n in missing))
        overrides.setdefault("num_query_groups", overrides["num_attention_heads"])
        if overrides.get("num_experts") and "moe_ffn_hidden_size" not in overrides:
            overrides["moe_ffn_hidden_size"] = overrides["ffn_hidden_size"]
        return ModelShape(name="custom", **overrides)
    return dataclasses.replace(presets.model(args.model), **overrides)


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    hw = presets.gpu(args.gpu)
    overrides = {field: getattr(args, flag) for flag, field in _GPU_FIELDS.items() if getattr(args, flag) is not None}
    if "gpus_per_node" in overrides:
        overrides["gpus_per_node"] = int(overrides["gpus_per_node"])
    return dataclasses.replace(hw, **overrides)


def format_plan(plan: Plan) -> str:
    from .flags import longctx_flags, megatron_flags

    m, hw, mem, t = plan.model, plan.hardware, plan.memory, plan.time
    lines = [f"{m.name} at {plan.seq_length:,} tokens on {plan.num_gpus} x {hw.name} "
             f"({hw.memory_gib:.0f} GiB, {hw.bf16_tflops:.0f} bf16 TFLOPS)",
             f"recommended: {describe(plan)}", "", "predicted memory per GPU (GiB):"]
    lines += [f"  {name:<36}{value / GIB:>9.1f}" for name, value in mem.rows()]
    lines.append(f"  {'usable (of ' + format(hw.memory_gib, '.0f') + ')':<36}{plan.usable_bytes / GIB:>9.1f}")
    lines += ["", "predicted step time (s):"]
    for name in ("matmul", "attention", "cp_exposed", "tp_comm", "dp_exposed", "offload_exposed"):
        lines.append(f"  {name:<36}{getattr(t, name):>9.2f}")
    lines += [f"  {'total':<36}{t.total:>9.2f}",
              f"  tokens/s per GPU {plan.tokens_per_s_per_gpu:,.0f}, MFU {plan.mfu:.1%}"]
    par = plan.parallel
    if par.cp > 1 and par.cp_comm_type in ("p2p", "a2a+p2p"):
        inter = par.tp * par.cp > hw.gpus_per_node
        need = ring_overlap_tokens(m, hw, inter_node=inter)
        have = par.micro_batch * plan.seq_length / par.cp
        lines.append(f"  ring overlap: {have:,.0f} tokens/GPU vs {need:,.0f} needed to hide K/V transfers over "
                     f"{'the network' if inter else 'NVLink'} ((F/B)·(hkv/hq)·e)")
    lines += ["",
              "flags:", "  " + shlex.join(megatron_flags(plan)), "  " + shlex.join(longctx_flags(plan))]
    return "\n".join(lines)


def plan_to_json(plan: Plan) -> dict:
    from .flags import longctx_flags, megatron_flags

    return {
        "model": dataclasses.asdict(plan.model), "seq_length": plan.seq_length, "num_gpus": plan.num_gpus,
        "hardware": dataclasses.asdict(plan.hardware), "parallel": dataclasses.asdict(plan.parallel),
        "options": dataclasses.asdict(plan.options), "summary": describe(plan),
        "memory_gib": {name: value / GIB for name, value in plan.memory.rows()},
        "step_time_s": {**{k: v for k, v in dataclasses.asdict(plan.time).items() if k != "model_flops_per_gpu"},
                        "total": plan.time.total},
        "tokens_per_s_per_gpu": plan.tokens_per_s_per_gpu, "mfu": plan.mfu,
        "megatron_flags": megatron_flags(plan), "longctx_flags": longctx_flags(plan),
    }


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        m, hw = model_from_args(args), hardware_from_args(args)
        constraints = Constraints(tp=args.tp, cp=args.cp, cp_comm_type=args.cp_comm_type, recompute=args.recompute,
                                  offload=args.offload, tiled_mlp_tiles=args.tiled_mlp_tiles,
                                  tiled_loss_tiles=args.tiled_loss_tiles, optimizer_offload=args.optimizer_offload)
        plan = recommend(m, args.seq_length, args.num_gpus, hw, constraints, micro_batch=args.micro_batch_size)
    except PlanInfeasible as exc:
        print(f"megatron-longctx plan: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"megatron-longctx plan: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(plan_to_json(plan), fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
