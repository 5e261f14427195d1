"""The planner's header comment of the recipes in ``examples/``, computed from each recipe's own flags.

    python -m megatron_longctx.plan.recipes examples/llama3_*.sh           # rewrite the headers
    python -m megatron_longctx.plan.recipes --check examples/llama3_*.sh   # exit 1 if one is stale

The header states what the planner predicts for the command line the recipe runs (layout, memory per
GPU, step-time range, TFLOP/s and MFU in Megatron's convention, the dataloader-mask warning when the
recipe leaves Megatron's default on), and what the planner itself would pick for the same job.  Only
the comment block that starts with ``# Planner`` changes; the command lines are left as they are.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import textwrap

from . import presets
from .cli import warnings
from .model import GIB, MemoryOptions, ModelShape, Parallel
from .recommend import recommend
from .search import Constraints, Plan, PlanInfeasible, describe, evaluate

GPU = "h200"
_SUBSTITUTE = {'"$TRAIN_ITERS"': "20", '"$OUTPUT_DIR/checkpoints"': "runs/ckpt",
               '"$OUTPUT_DIR/tensorboard"': "runs/tb",
               '"${DATA_ARGS[@]}"': "--mock-data --tokenizer-type NullTokenizer --vocab-size 128255", '"$@"': ""}
_HEADER = re.compile(r"^# Planner.*\n(?:#   .*\n)*", re.MULTILINE)
# A recipe may source a file of examples/ that defines flag arrays (NAME=( ... ) at the start of a line).
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
_SOURCE = re.compile(r'^source "\$\(dirname "\$\{BASH_SOURCE\[0\]\}"\)/([\w./-]+)"', re.MULTILINE)
_ARRAY = re.compile(r"^(\w+)=\((.*?)^\)", re.MULTILINE | re.DOTALL)


def _expand_arrays(command: str, text: str) -> str:
    """``command`` with each ``"${NAME[@]}"`` of an array the recipe's sourced files define written out."""
    for name in _SOURCE.findall(text):
        with open(os.path.join(EXAMPLES, name), encoding="utf-8") as fh:
            for var, body in _ARRAY.findall(fh.read()):
                command = command.replace(f'"${{{var}[@]}}"', " ".join(body.split()))
    return command


def training_args(text: str) -> list[str]:
    """The arguments after ``pretrain_gpt.py`` in the recipe's torchrun command."""
    command = _expand_arrays(text[text.index("torchrun"):].replace("\\\n", " "), text)
    for var, value in _SUBSTITUTE.items():
        command = command.replace(var, value)
    tokens = shlex.split(command.splitlines()[0])
    return tokens[tokens.index("$MEGATRON_LM/pretrain_gpt.py") + 1:]


def num_gpus(text: str) -> int:
    """``--nproc-per-node`` × the recipe's default ``NNODES``."""
    per_node = int(re.search(r"--nproc-per-node (\d+)", text).group(1))
    nodes = re.search(r':\s*"\$\{NNODES:=(\d+)\}"', text)
    return per_node * (int(nodes.group(1)) if nodes else 1)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    for flag in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads", "--seq-length",
                 "--micro-batch-size", "--global-batch-size", "--tensor-model-parallel-size",
                 "--context-parallel-size", "--longctx-tiled-mlp-tiles", "--longctx-tiled-loss-tiles",
                 "--longctx-recompute-tiles"):
        p.add_argument(flag, type=int, default=None)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-query-groups", type=int, default=None)
    p.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs="+", default=None)
    for flag in ("--cp-comm-type", "--recompute-granularity",
                 "--longctx-offload-policy", "--longctx-cp-kernel-backend", "--main-grads-dtype", "--fp8-format"):
        p.add_argument(flag, default=None)
    for flag in ("--optimizer-cpu-offload", "--use-megatron-fsdp", "--sequence-parallel"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--no-create-attention-mask-in-dataloader", dest="mask", action="store_false", default=True)
    return p


def _preset(args: argparse.Namespace) -> ModelShape:
    for m in presets.MODELS.values():
        if (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads) == (
                args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads):
            return m
    raise ValueError(f"no planner preset has --num-layers {args.num_layers} --hidden-size {args.hidden_size}")


def recipe_plan(text: str) -> Plan:
    """The planner's evaluation of the configuration the recipe's command line runs."""
    args, _ = _parser().parse_known_args(training_args(text))
    m, gpus = _preset(args), num_gpus(text)
    tp, cp, pp = args.tensor_model_parallel_size, args.context_parallel_size, args.pipeline_model_parallel_size
    dp = gpus // (tp * cp * pp)
    comm = (args.cp_comm_type or "p2p") if cp > 1 else "p2p"
    u = args.hierarchical_context_parallel_sizes[0] if comm == "a2a+p2p" else 1
    par = Parallel(tp=tp, cp=cp, dp=dp, pp=pp, cp_comm_type=comm, ulysses_size=u, micro_batch=args.micro_batch_size,
                   micro_batches=max(1, args.global_batch_size // (args.micro_batch_size * dp)))
    full = args.recompute_granularity == "full"
    offload = {"checkpoint": "checkpoint", "layers": "layers"}.get(args.longctx_offload_policy, "none")
    backend = {"flash_attn": "flash_attn2", "sdpa_cuda": "sdpa_cuda"}.get(args.longctx_cp_kernel_backend, "auto")
    opt = MemoryOptions(recompute="full" if full else "none", offload=offload,
                        tiled_mlp_tiles=args.longctx_tiled_mlp_tiles or 1,
                        tiled_loss_tiles=args.longctx_tiled_loss_tiles or 1,
                        recompute_tiles=args.longctx_recompute_tiles or 1,
                        sequence_parallel=args.sequence_parallel or tp == 1,  # SP means nothing at TP 1
                        optimizer_offload=args.optimizer_cpu_offload, main_grads_dtype=args.main_grads_dtype or "fp32",
                        fsdp=args.use_megatron_fsdp, fp8=args.fp8_format is not None, attention_backend=backend,
                        dataloader_mask=args.mask)
    return evaluate(m, args.seq_length, gpus, presets.gpu(GPU), par, opt)


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, 104, initial_indent="#   ", subsequent_indent="#     ")


def header(text: str) -> str:
    """The ``# Planner`` comment block for a recipe's text."""
    plan = recipe_plan(text)
    mem, t = plan.memory, plan.time
    fast, slow = plan.time_range
    seq = plan.seq_length
    seq_text = f"{seq >> 20}M" if seq % (1 << 20) == 0 else f"{seq >> 10}K"
    command = f"megatron-longctx plan --model {plan.model.name} --seq-length {seq_text} --num-gpus {plan.num_gpus} --gpu {GPU}"
    lines = ["# Planner (python -m megatron_longctx.plan.recipes regenerates this from the flags below):"]
    lines += _wrap(f"this recipe: {describe(plan)}; dataloader mask {'ON' if plan.options.dataloader_mask else 'off'}")
    parts = ", ".join(f"{n} {v / GIB:.1f}" for n, v in mem.rows() if n not in ("peak", "host (offload)"))
    lines += _wrap(f"predicted memory per GPU (GiB): {parts}")
    host = f"; host {mem.host_offload / GIB:,.0f} GiB per GPU" if mem.host_offload else ""
    lines += _wrap(f"predicted peak {mem.peak / GIB:,.1f} GiB of {plan.hardware.memory_gib:.0f} GiB "
                   f"({'fits' if plan.fits else 'does NOT fit'}){host}")
    att = plan.efficiencies.point("expected", plan.parallel.cp)[0]
    lines += _wrap(f"predicted step {t.total:,.1f} s (range {fast:,.1f}-{slow:,.1f} s), {plan.tokens_per_s_per_gpu:,.0f} "
                   f"tokens/s per GPU, {plan.tflops_per_gpu:,.0f} TFLOP/s per GPU, MFU {plan.mfu:.0%} in Megatron's "
                   f"num_floating_point_operations convention (attention {att:.2f} of peak in-step, backend "
                   f"{plan.options.attention_backend})")
    for w in warnings(plan):
        lines += _wrap(w)
    try:
        pick = recommend(plan.model, seq, plan.num_gpus, plan.hardware, Constraints())
        lines += _wrap(f"the planner's pick for this job ({command}): {describe(pick)}, peak "
                       f"{pick.memory.peak / GIB:.1f} GiB, {pick.tokens_per_s_per_gpu:,.0f} tokens/s per GPU "
                       f"(global batch {pick.global_batch_size})")
    except PlanInfeasible:
        lines += _wrap(f"the planner finds nothing that fits this job ({command})")
    return "\n".join(lines) + "\n"


def regenerate(text: str) -> str:
    if not _HEADER.search(text):
        raise ValueError("the recipe has no '# Planner' comment block to regenerate")
    return _HEADER.sub(lambda _: header(text), text, count=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_longctx.plan.recipes", description=__doc__.split("\n\n")[0])
    p.add_argument("recipes", nargs="+")
    p.add_argument("--check", action="store_true", help="only report stale headers (exit 1)")
    args = p.parse_args(argv)
    stale = 0
    for path in args.recipes:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        new = regenerate(text)
        if new != text:
            stale += 1
            if args.check:
                print(f"{path}: the planner header is stale; run python -m megatron_longctx.plan.recipes {path}")
            else:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(new)
                print(f"{path}: header regenerated")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
