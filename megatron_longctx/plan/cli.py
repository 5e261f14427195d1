"""``megatron-longctx plan``: which configuration fits, how fast it runs, and the flags for it.

    megatron-longctx plan --model llama3-8b --seq-length 1048576 --num-gpus 8 --gpu h200
    megatron-longctx plan --model llama3-8b --seq-length 1M --num-gpus 1 --gpu h200   # what 1 GPU can do
    megatron-longctx plan --model custom --num-layers 4 --hidden-size 1024 ... --gpu-memory-gib 80 ...

Prints the chosen layout, the predicted memory per GPU by part, the predicted step time by part as a
range over the efficiency bands, TFLOP/s and MFU in Megatron's ``num_floating_point_operations``
convention, and the Megatron-LM + ``--longctx-*`` flags; ``--json PATH`` also writes them.  Exit status
2 with a message naming the dominant memory term and the smallest change that fits when nothing does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from typing import Callable, Optional

from . import presets
from .efficiency import ATTENTION_BACKENDS, load_calibration, resolve
from .flops import model_flops
from .model import GIB, GRAD_DTYPES, MODEL_STATE_TARGETS, ModelShape, parse_tokens
from .recommend import recommend
from .search import CP_COMM_TYPES, Constraints, Plan, PlanInfeasible, describe
from .state_offload import state_offload
from .timing import Hardware, StepTime, ring_overlap_tokens

_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                 "ffn_hidden_size", "vocab_size", "num_experts", "moe_router_topk", "moe_ffn_hidden_size")
_GPU_FIELDS = {"gpu_memory_gib": "memory_gib", "bf16_tflops": "bf16_tflops", "fp8_tflops": "fp8_tflops",
               "nvlink_gbps": "intra_node_gbps", "network_gbps": "inter_node_gbps", "host_link_gbps": "host_gbps",
               "host_memory_gib": "host_memory_gib", "nvme_gbps": "nvme_gbps"}


def _integer(flag: str, minimum: int = 1) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: give an integer >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} {value}: must be >= {minimum}")
        return value
    return parse


def _number(flag: str, *, minimum: float = 0.0, inclusive: bool = False, maximum: Optional[float] = None,
            ) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: give a number") from None
        low_ok = value >= minimum if inclusive else value > minimum
        if not low_ok or value != value or (maximum is not None and value > maximum):
            bound = f"{'>=' if inclusive else '>'} {minimum:g}" + (f" and <= {maximum:g}" if maximum else "")
            raise argparse.ArgumentTypeError(f"{flag} {text}: must be {bound}")
        return value
    return parse


def _tokens(text: str) -> int:
    try:
        value = parse_tokens(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seq-length {text!r}: give tokens as an integer, or with K/M (e.g. "
                                         "131072, 128K, 1M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--seq-length {text!r}: must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-longctx plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--model", default="llama3-8b", help=f"preset ({', '.join(presets.MODELS)}) or 'custom'")
    p.add_argument("--seq-length", type=_tokens, required=True, help="tokens per sequence (e.g. 131072, 128K, 1M)")
    p.add_argument("--num-gpus", type=_integer("--num-gpus"), required=True)
    p.add_argument("--micro-batch-size", type=_integer("--micro-batch-size"), default=1)
    p.add_argument("--global-batch-size", type=_integer("--global-batch-size"), default=None,
                   help="sequences per step (default: micro batch × DP, one micro-batch per step)")
    g = p.add_argument_group("model shape (overrides the preset; all required with --model custom)")
    for name in _SHAPE_FIELDS:
        flag = "--" + name.replace("_", "-")
        g.add_argument(flag, type=_integer(flag), default=None)
    g.add_argument("--activation", choices=("swiglu", "gelu"), default=None)
    h = p.add_argument_group("hardware (overrides the --gpu preset)")
    h.add_argument("--gpu", default="h200", help=f"preset: {', '.join(presets.GPUS)}")
    for name in _GPU_FIELDS:
        flag = "--" + name.replace("_", "-")
        h.add_argument(flag, type=_number(flag, inclusive=name == "fp8_tflops"), default=None,
                       help="per node, shared by the job's GPUs on it" if name == "host_memory_gib" else None)
    h.add_argument("--gpus-per-node", type=_integer("--gpus-per-node"), default=None)
    e = p.add_argument_group("efficiencies (default: per GPU generation and --attention-backend)")
    e.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="attention kernel: auto (the plugin's pick: flash-attn 2 / SDPA), flash_attn2, sdpa_cuda, "
                        "flash_attn3, te_cudnn (Megatron's own TE attention, as NeMo runs)")
    e.add_argument("--attention-efficiency", type=_number("--attention-efficiency", maximum=1.0), default=None,
                   help="achieved share of the bf16 peak for attention fwd+bwd in a training step")
    e.add_argument("--matmul-efficiency", type=_number("--matmul-efficiency", maximum=1.0), default=None,
                   help="achieved share of the GEMM peak (bf16, or FP8 with --fp8)")
    e.add_argument("--calibrate", metavar="FILE", default=None,
                   help="read measured TFLOP/s from a scripts/gpu_check.py JSON")
    c = p.add_argument_group("fix a choice instead of searching it")
    c.add_argument("--tp", type=_integer("--tp"), default=None)
    c.add_argument("--cp", type=_integer("--cp"), default=None)
    c.add_argument("--pp", type=_integer("--pp"), default=None, help="pipeline stages (1F1B); default 1")
    c.add_argument("--cp-comm-type", choices=CP_COMM_TYPES, default=None)
    c.add_argument("--recompute", choices=("none", "full"), default=None)
    c.add_argument("--offload", choices=("none", "checkpoint", "layers"), default=None)
    c.add_argument("--tiled-mlp-tiles", type=_integer("--tiled-mlp-tiles"), default=None)
    c.add_argument("--tiled-loss-tiles", type=_integer("--tiled-loss-tiles"), default=None)
    c.add_argument("--recompute-tiles", type=_integer("--recompute-tiles"), default=None,
                   help="replay full recompute's layers in this many sequence tiles (--longctx-recompute-tiles; "
                        "1 = off; needs TP 1, CP 1 or --cp-comm-type all_gather, a dense model)")
    c.add_argument("--optimizer-offload", action=argparse.BooleanOptionalAction, default=None)
    j = p.add_argument_group("Megatron options of the job")
    j.add_argument("--main-grads-dtype", choices=GRAD_DTYPES, default="fp32")
    j.add_argument("--megatron-fsdp", action="store_true", help="Megatron-FSDP, optim_grads_params (ZeRO-3)")
    j.add_argument("--fp8", action="store_true", help="FP8 GEMMs through Transformer Engine (--fp8-format hybrid)")
    j.add_argument("--create-attention-mask-in-dataloader", action=argparse.BooleanOptionalAction, default=False,
                   help="count Megatron's dense [b, 1, s, s] dataloader mask (Megatron's default is on; the plan "
                        "turns it off)")
    j.add_argument("--model-state-offload", nargs="?", const="host", choices=MODEL_STATE_TARGETS, default=None,
                   help="--longctx-model-state-offload host|disk (no value: host): bf16 weights streamed per layer "
                        "from host memory or NVMe, grads accumulated on the host, AdamW on the CPU "
                        "(docs/model-state-offload.md)")
    p.add_argument("--max-seq", action="store_true",
                   help="also print the longest sequence these GPUs train, with and without model-state offload")
    p.add_argument("--json", default=None, help="also write the plan as JSON to this path")
    return p


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
        m = ModelShape(name="custom", **overrides)
    else:
        m = dataclasses.replace(presets.model(args.model), **overrides)
    if m.num_experts is not None and m.moe_router_topk > m.num_experts:
        raise ValueError(f"--moe-router-topk {m.moe_router_topk} must be <= --num-experts {m.num_experts}")
    return m


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    hw = presets.gpu(args.gpu)
    overrides = {field: getattr(args, flag) for flag, field in _GPU_FIELDS.items() if getattr(args, flag) is not None}
    if args.gpus_per_node is not None:
        overrides["gpus_per_node"] = args.gpus_per_node
    return dataclasses.replace(hw, **overrides)


def constraints_from_args(args: argparse.Namespace) -> Constraints:
    return Constraints(tp=args.tp, cp=args.cp, pp=args.pp, cp_comm_type=args.cp_comm_type, recompute=args.recompute,
                       offload=args.offload, tiled_mlp_tiles=args.tiled_mlp_tiles,
                       tiled_loss_tiles=args.tiled_loss_tiles, recompute_tiles=args.recompute_tiles,
                       optimizer_offload=args.optimizer_offload,
                       global_batch_size=args.global_batch_size, main_grads_dtype=args.main_grads_dtype,
                       fsdp=args.megatron_fsdp, fp8=args.fp8, attention_backend=args.attention_backend,
                       dataloader_mask=args.create_attention_mask_in_dataloader,
                       model_state_offload=args.model_state_offload)


def _time_lines(plan: Plan) -> list[str]:
    t = plan.time
    fast, slow = plan.time_range
    lines = ["", f"predicted step time (s), {t.micro_batches} micro-batch(es) per step:"]
    lines += [f"  {name:<36}{getattr(t, name):>9.2f}" for name in StepTime.PARTS if getattr(t, name)]
    lines.append(f"  {'total (expected)':<36}{t.total:>9.2f}   range {fast:.2f}-{slow:.2f}")
    eff = plan.efficiencies
    nemo = model_flops(plan.model, plan.seq_length, plan.global_batch_size, "nemo") / plan.parallel.world
    lines += [f"  tokens/s per GPU {plan.tokens_per_s_per_gpu:,.0f}; {plan.tflops_per_gpu:,.0f} TFLOP/s per GPU and "
              f"MFU {plan.mfu:.1%} of the {plan.hardware.bf16_tflops:.0f} bf16 peak in Megatron's "
              "num_floating_point_operations convention (causal attention, 6·s²·H per layer)",
              f"  (NeMo's convention, non-causal 12·s²·H, would read {nemo / t.total / 1e12:,.0f} TFLOP/s per GPU)",
              f"  efficiencies: attention {eff.point('expected', plan.parallel.cp)[0]:.2f} in-step"
              + (f" = {eff.attention.expected:.2f} per kernel ({eff.attention.low:.2f}-{eff.attention.high:.2f})"
                 f" x {eff.cp_factor:.2f} CP-step factor" if plan.parallel.cp > 1 and eff.cp_factor != 1 else
                 f" ({eff.attention.low:.2f}-{eff.attention.high:.2f})") + f"; {eff.attention.source}",
              f"                matmul {eff.matmul.expected:.2f} ({eff.matmul.low:.2f}-{eff.matmul.high:.2f};"
              f" {eff.matmul.source})"]
    return lines


def format_plan(plan: Plan) -> str:
    from .flags import longctx_flags, megatron_flags

    m, hw, mem = plan.model, plan.hardware, plan.memory
    lines = [f"{m.name} at {plan.seq_length:,} tokens on {plan.num_gpus} x {hw.name} "
             f"({hw.memory_gib:.0f} GiB, {hw.bf16_tflops:.0f} bf16 TFLOPS)",
             f"recommended: {describe(plan)}", "",
             "predicted memory per GPU (GiB)" + (f", pipeline stage {mem.stage}" if plan.parallel.pp > 1 else "") + ":"]
    lines += [f"  {name:<36}{value / GIB:>9.1f}" for name, value in mem.rows()]
    lines.append(f"  {'usable (of ' + format(hw.memory_gib, '.0f') + ')':<36}{plan.usable_bytes / GIB:>9.1f}")
    lines.append(f"  {'host usable per GPU':<36}{plan.host_usable_bytes / GIB:>9.1f}")
    lines += _time_lines(plan)
    par = plan.parallel
    if par.cp > 1 and par.cp_comm_type in ("p2p", "a2a+p2p"):
        inter = par.tp * par.cp > hw.gpus_per_node
        need = ring_overlap_tokens(m, hw, inter_node=inter)
        have = par.micro_batch * plan.seq_length / par.cp
        lines.append(f"  ring overlap: {have:,.0f} tokens/GPU vs {need:,.0f} needed to hide K/V transfers over "
                     f"{'the network' if inter else 'NVLink'} ((F/B)·(hkv/hq)·e)")
    lines += warnings(plan)
    if plan.options.attention_backend == "te_cudnn":
        lines.append("note: te_cudnn times Megatron's own Transformer Engine attention and CP (as NeMo runs), not this "
                     "package's attention: the Megatron flags below apply to pretrain_gpt.py run directly; under "
                     "megatron_longctx.launch the plugin's attention replaces it")
    lines += state_offload_lines(plan)
    lines += ["", "flags:", "  " + shlex.join(megatron_flags(plan)), "  " + shlex.join(longctx_flags(plan))]
    return "\n".join(lines)


def state_offload_lines(plan: Plan) -> list[str]:
    """Model-state offload: what stays off the GPU, what one layer moves per micro-batch, whether it hides."""
    so = state_offload(plan.model, plan.parallel, plan.options, plan.memory.stage)
    if so is None:
        return []
    hw, t = plan.hardware, plan.time
    fwd_s = t.layer_forward_s
    layer = so.layer_copies(hw, fwd_s, plan.options.recompute == "full")
    lines = ["", f"model-state offload ({so.target}), per GPU:"]
    lines += [f"  host: {name:<32}{value / GIB:>9.1f} GiB" for name, value in so.host_parts().items() if value]
    lines += [f"  disk: {name:<32}{value / GIB:>9.1f} GiB" for name, value in so.disk_parts().items()]
    link = f"NVMe {hw.nvme_gbps:.0f} GB/s then PCIe" if so.target == "disk" else "PCIe"
    lines += [f"  one layer ({so.layer_params / 1e6:,.1f}M parameters) per micro-batch: {so.weights_in / 1e9:.2f} GB "
              f"of bf16 weights in for the forward and again for the backward ({link}: {layer.weights_in_s:.3f} s "
              f"each), {so.grads_out / 1e9:.2f} GB of main grads out ({layer.grads_out_s:.3f} s)",
              f"  against its compute: forward {layer.forward_s:.3f} s, "
              f"{'recompute + ' if plan.options.recompute == 'full' else ''}backward {layer.backward_s:.3f} s: "
              + ("copies hidden" if layer.hidden else f"{layer.exposed_s:.3f} s exposed per layer")
              + f"; embedding and output layer {so.other_copies_s(hw):.3f} s exposed",
              f"  optimizer step on the CPU (AdamW{', its states through NVMe' if so.target == 'disk' else ''}): "
              f"{so.optimizer_step_s(hw):.1f} s per step"]
    return lines


def warnings(plan: Plan) -> list[str]:
    out = []
    if plan.options.dataloader_mask:
        out.append(f"warning: Megatron's dataloader builds a dense [b, 1, s, s] attention mask: "
                   f"{plan.memory.dataloader_mask / GIB:,.1f} GiB per GPU and {5 * plan.seq_length ** 2 / GIB:,.0f} "
                   "GiB of host memory per sample while it is made; this package's attention ignores it: add "
                   "--no-create-attention-mask-in-dataloader")
    return out


def max_seq_lines(m: ModelShape, num_gpus: int, hw: Hardware, c: Constraints, mb: int, eff) -> list[str]:
    from .advice import longest_sequence

    lines = [f"longest sequence {num_gpus} x {hw.name} trains ({m.name}):"]
    target = c.model_state_offload or "host"
    for label, cons in (("without model-state offload", dataclasses.replace(c, model_state_offload=None)),
                        (f"with model-state offload (--longctx-model-state-offload {target})",
                         dataclasses.replace(c, model_state_offload=target, optimizer_offload=None))):
        best = longest_sequence(m, num_gpus, hw, cons, mb, eff)
        if best is None:
            lines.append(f"  {label}: none (not even {8192:,} tokens)")
        else:
            lines.append(f"  {label}: {best.seq_length:,} tokens ({best.seq_length / 1024:,.0f}K): {describe(best)}, "
                         f"{best.memory.peak / GIB:.1f} GiB, {best.memory.host_offload / GIB:.0f} GiB host, "
                         f"step {best.time.total:,.0f} s")
    return lines


def plan_to_json(plan: Plan) -> dict:
    from .flags import longctx_flags, megatron_flags

    fast, slow = plan.time_range
    return {
        "model": dataclasses.asdict(plan.model), "seq_length": plan.seq_length, "num_gpus": plan.num_gpus,
        "hardware": dataclasses.asdict(plan.hardware), "parallel": dataclasses.asdict(plan.parallel),
        "options": dataclasses.asdict(plan.options), "summary": describe(plan),
        "memory_gib": {name: value / GIB for name, value in plan.memory.rows()},
        "step_time_s": {**{k: getattr(plan.time, k) for k in StepTime.PARTS}, "total": plan.time.total,
                        "range": [fast, slow]},
        "efficiencies": dataclasses.asdict(plan.efficiencies),
        "tokens_per_s_per_gpu": plan.tokens_per_s_per_gpu, "tflops_per_gpu": plan.tflops_per_gpu, "mfu": plan.mfu,
        "flops_convention": "megatron num_floating_point_operations (causal attention)",
        "megatron_flags": megatron_flags(plan), "longctx_flags": longctx_flags(plan),
    }


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        m, hw, c = model_from_args(args), hardware_from_args(args), constraints_from_args(args)
        calibration = load_calibration(args.calibrate, hw.bf16_tflops) if args.calibrate else None
        eff = resolve(hw.family, args.attention_backend, args.fp8, attention=args.attention_efficiency,
                      matmul=args.matmul_efficiency, calibration=calibration)
        plan = recommend(m, args.seq_length, args.num_gpus, hw, c, micro_batch=args.micro_batch_size, eff=eff)
    except PlanInfeasible as exc:
        print(f"megatron-longctx plan: {exc}", file=sys.stderr)
        if args.num_gpus == 1 or args.max_seq:
            print("\n".join(max_seq_lines(m, args.num_gpus, hw, c, args.micro_batch_size, eff)), file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"megatron-longctx plan: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if args.max_seq:
        print("\n" + "\n".join(max_seq_lines(m, args.num_gpus, hw, c, args.micro_batch_size, eff)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(plan_to_json(plan), fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
