"""The planner against NeMo's published long-sequence runs: a table of published vs predicted step times.

    python -m megatron_longctx.plan.published [--attention-efficiency 0.5] [--json out.json]

NeMo's "Long Sequence Performance" table (Llama-2-7B, DGX-H100, FP8 GEMMs, TE cuDNN attention, PP 1,
as many GPUs as K tokens) reports TFLOP/s per GPU in NeMo's convention (attention counted
non-causally).  A published step time is NeMo-FLOPs of the step / (TFLOP/s × GPUs).  The table gives
no batch size; the same page's B200 table keeps 4M tokens per step, used here (it only sets how often
the gradient reduction is paid).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from . import presets
from .efficiency import resolve
from .flops import model_flops
from .model import MemoryOptions, Parallel
from .search import evaluate

# (K tokens, TP, CP, DP, published TFLOP/s per GPU)
NEMO_H100 = ((32, 2, 2, 8, 610), (64, 4, 2, 8, 574), (128, 4, 4, 8, 555), (256, 4, 8, 8, 549),
             (512, 8, 16, 4, 549), (1024, 8, 32, 4, 536))
TOKENS_PER_STEP = 4 << 20
# NeMo's Llama-3-8B FP8 DGX-B200 rows with CP (NeMo 25.04): (K tokens, TP, CP, DP, TFLOP/s per GPU, batch)
NEMO_B200 = ((32, 1, 4, 2, 1624, 128), (64, 1, 4, 4, 1600, 64), (128, 2, 4, 4, 1588, 32), (256, 4, 4, 4, 1590, 16),
             (512, 4, 8, 4, 1619, 8), (1024, 4, 16, 4, 1608, 4))


def nemo_rows(attention_efficiency: Optional[float] = None) -> list[dict]:
    """Published and predicted step seconds for every row, with the planner's TE + FP8 settings."""
    m, hw = presets.model("llama2-7b"), presets.gpu("h100")
    eff = resolve(hw.family, "te_cudnn", True, attention=attention_efficiency)
    rows = []
    for k, tp, cp, dp, tflops in NEMO_H100:
        s = k * 1024
        gbs = max(TOKENS_PER_STEP // s, dp)
        par = Parallel(tp=tp, cp=cp, dp=dp, micro_batches=gbs // dp)
        plan = evaluate(m, s, tp * cp * dp, hw, par, MemoryOptions(fp8=True, attention_backend="te_cudnn"), eff)
        published = model_flops(m, s, gbs, "nemo") / (tflops * 1e12 * tp * cp * dp)
        fast, slow = plan.time_range
        rows.append({"seq_k": k, "tp": tp, "cp": cp, "dp": dp, "published_tflops": tflops,
                     "published_step_s": published, "predicted_step_s": plan.time.total,
                     "predicted_range_s": [fast, slow], "ratio": plan.time.total / published,
                     "attention_share": plan.time.attention / plan.time.total, "fits": plan.fits,
                     "peak_gib": plan.memory.peak / (1 << 30)})
    return rows


def nemo_b200_rows() -> list[dict]:
    """Published and predicted step seconds of the B200 table (its own batch sizes), planner defaults."""
    m, hw = presets.model("llama3-8b"), presets.gpu("b200")
    eff = resolve(hw.family, "te_cudnn", True)
    rows = []
    for k, tp, cp, dp, tflops, gbs in NEMO_B200:
        s = k * 1024
        par = Parallel(tp=tp, cp=cp, dp=dp, micro_batches=gbs // dp)
        plan = evaluate(m, s, tp * cp * dp, hw, par, MemoryOptions(fp8=True, attention_backend="te_cudnn"), eff)
        published = model_flops(m, s, gbs, "nemo") / (tflops * 1e12 * tp * cp * dp)
        rows.append({"seq_k": k, "tp": tp, "cp": cp, "dp": dp, "published_tflops": tflops,
                     "published_step_s": published, "predicted_step_s": plan.time.total,
                     "ratio": plan.time.total / published, "attention_share": plan.time.attention / plan.time.total})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_longctx.plan.published", description=__doc__.split("\n\n")[0])
    p.add_argument("--attention-efficiency", type=float, default=None, help="in-step value instead of the defaults")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = nemo_rows(args.attention_efficiency)
    print(f"{'seq':>6} {'TP':>3} {'CP':>3} {'DP':>3} {'TFLOP/s':>8} {'published s':>12} {'predicted s':>12} "
          f"{'range s':>15} {'pred/pub':>9} {'attn':>5}")
    for r in rows:
        lo, hi = r["predicted_range_s"]
        print(f"{r['seq_k']:>5}K {r['tp']:>3} {r['cp']:>3} {r['dp']:>3} {r['published_tflops']:>8} "
              f"{r['published_step_s']:>12.2f} {r['predicted_step_s']:>12.2f} {lo:>7.2f}-{hi:<7.2f} "
              f"{r['ratio']:>9.3f} {r['attention_share']:>5.0%}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
