"""Achieved shares of peak for GEMMs and attention, per GPU generation and kernel backend, and calibration.

Attention efficiency is (7·b·s²·H causal fwd+bwd FLOPs, the count of :func:`.timing.attention_flops`) /
(seconds × dense bf16 peak): the table holds one kernel call's value, and a step with CP > 1 keeps
:data:`CP_STEP_FACTOR` of it (blocks split for load balance, online-softmax merges, launches);
``--attention-efficiency`` gives the in-step value directly.  Matmul efficiency is the model's GEMM FLOPs / (seconds × the peak of the GEMM
precision: bf16, or FP8 with ``--fp8-format``).  Every default carries its source; each comes as
(low, expected, high) so that ``plan`` prints a range, and ``--attention-efficiency`` /
``--matmul-efficiency`` or a measured ``gpu_check`` JSON (``--calibrate``) replace it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

# Attention kernel backends the planner knows.  "auto" is the plugin's automatic pick on a CUDA
# machine (flash-attn 2, else torch SDPA's flash kernel, which is FlashAttention-2 too).
ATTENTION_BACKENDS = ("auto", "flash_attn2", "sdpa_cuda", "flash_attn3", "te_cudnn")
# Backends that expand K/V (and, in backward, dK/dV) to every query head for GQA.
GQA_EXPANDING_BACKENDS = ("auto", "flash_attn2", "sdpa_cuda")


@dataclasses.dataclass(frozen=True)
class Band:
    """An efficiency as (low, expected, high) shares of peak; ``source`` says where it comes from."""

    low: float
    expected: float
    high: float
    source: str

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.expected <= self.high <= 1:
            raise ValueError(f"efficiency band ({self.low}, {self.expected}, {self.high}) must satisfy "
                             "0 < low <= expected <= high <= 1")

    @staticmethod
    def fixed(value: float, source: str, spread: float = 0.1) -> "Band":
        """A user- or measurement-given value with ±``spread`` around it (capped at 1)."""
        return Band(value * (1 - spread), value, min(1.0, value * (1 + spread)), source)


# Attention kernels alone, fwd+bwd, as a share of the dense bf16 peak (7·s²·H FLOPs).
_FA2 = ("FlashAttention-2 fwd+bwd reaches ~35% of H100 bf16 peak (FlashAttention-3 paper, Shah et al. 2024, "
        "Fig. 5-6 baselines)")
_FA3 = "FlashAttention-3 fwd 60-75%, bwd 45-55% of H100 bf16 peak (Shah et al. 2024)"
_CUDNN = ("cuDNN 9 fused attention (TE) ~ FlashAttention-3 class on Hopper; 0.53 x CP_STEP_FACTOR 0.6 = 0.32 "
          "reproduces NeMo's Llama-2-7B H100 long-sequence table (6 rows, 32K-1M) within 4%")
_CUDNN_B200 = ("cuDNN fused attention on B200 at head dim 128: ~0.55 of bf16 peak fwd, ~0.45 bwd (FlashAttention-4 "
               "paper's cuDNN 9.13 baseline), 0.475 fwd+bwd in the 7·s²·H count")
ATTENTION: dict[tuple[str, str], Band] = {
    ("hopper", "te_cudnn"): Band(0.47, 0.53, 0.60, _CUDNN),
    ("hopper", "flash_attn3"): Band(0.45, 0.53, 0.62, _FA3),
    ("hopper", "flash_attn2"): Band(0.30, 0.35, 0.40, _FA2),
    ("hopper", "sdpa_cuda"): Band(0.30, 0.35, 0.40, _FA2 + "; SDPA's flash kernel is FlashAttention-2"),
    ("hopper", "auto"): Band(0.30, 0.35, 0.40, _FA2 + "; auto serves flash-attn 2 or SDPA's FA2 on NGC"),
    # Blackwell, from the kernels (in this planner's 7·s²·H count, bwd = 2.5 x fwd): B200's BF16 tensor cores
    # doubled Hopper's while the exponential units and shared memory did not, so cuDNN's fused attention at
    # head dim 128 reaches ~0.55 of the 2,250 TFLOP/s peak forward (FlashAttention-4, Zadouri et al. 2026:
    # 71%, 1.3x cuDNN 9.13) and ~0.45 backward (shared-memory bound): 7 / (2/0.55 + 5/0.45) ~ 0.475 alone.
    ("blackwell", "te_cudnn"): Band(0.40, 0.475, 0.55, _CUDNN_B200),
    ("blackwell", "flash_attn3"): Band(0.25, 0.32, 0.40, "FA3 targets Hopper's wgmma; on Blackwell ~ FA2"),
    ("blackwell", "flash_attn2"): Band(0.20, 0.27, 0.34, "FA2 (mma.sync) on Blackwell: below its Hopper share"),
    ("blackwell", "sdpa_cuda"): Band(0.20, 0.27, 0.34, "SDPA's flash kernel = FA2 on Blackwell"),
    ("blackwell", "auto"): Band(0.20, 0.27, 0.34, "auto = FA2 / SDPA on Blackwell"),
    # Ampere: FA2 reaches 50-73% of A100 peak fwd+bwd (Dao 2023, Fig. 4).
    ("ampere", "flash_attn2"): Band(0.50, 0.60, 0.70, "FlashAttention-2 paper (Dao 2023): 50-73% on A100"),
    ("ampere", "sdpa_cuda"): Band(0.50, 0.60, 0.70, "SDPA's flash kernel = FA2 on A100"),
    ("ampere", "auto"): Band(0.50, 0.60, 0.70, "auto = FA2 / SDPA on A100"),
    ("ampere", "te_cudnn"): Band(0.45, 0.55, 0.65, "cuDNN fused attention on A100 ~ FA2"),
}
# Share of a lone kernel's rate that attention keeps inside a CP > 1 step (blocks split for causal load
# balance, online-softmax merges, per-step launches), per backend.  TE's CP with cuDNN: 0.6, fitted with
# cuDNN's 0.53 to NeMo's table (above).  The plugin's kernels run the zigzag block schedule of
# ring-flash-attention, which keeps 0.90 of one flash-attn call on 8 x H800 at 8K tokens per GPU
# (that project's published benchmark; its plain ring keeps 0.54).  gpu_check's ring section measures it (--calibrate).
# Blackwell's TE rows keep the zigzag ring's 0.90: its shards are 32K-64K tokens per rank, where the per-step
# merges and launches are a few percent of a block; the Hopper 0.6 is a fit on H100 runs, not a property of
# the ring, and is not carried to another GPU generation.
CP_STEP_FACTOR = {("hopper", "te_cudnn"): 0.6, ("ampere", "te_cudnn"): 0.6}
PLUGIN_CP_STEP_FACTOR = 0.9

# GEMMs: Megatron/TE bf16 GEMMs of a 4K-8K hidden model reach 55-70% of dense peak in training steps
# (NeMo's 4K-sequence Llama-2-7B bf16 runs at ~520-560 model TFLOP/s on H100 with small attention
# share); FP8 GEMMs 40-50% of the FP8 peak (NeMo FP8 Llama-2-7B at 4K: 780 model TFLOP/s of 1,979).
MATMUL_BF16 = Band(0.5, 0.6, 0.7, "Megatron/TE bf16 GEMMs in NeMo's 4K-sequence runs (55-70% of peak)")
MATMUL_FP8 = Band(0.35, 0.42, 0.5, "TE FP8 GEMMs in NeMo's FP8 runs (~40-50% of the FP8 peak)")


def attention_band(family: str, backend: str) -> Band:
    """The default in-step attention efficiency of ``backend`` on a GPU generation."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend!r}: choose one of {', '.join(ATTENTION_BACKENDS)}")
    key = (family, backend)
    if key not in ATTENTION:
        raise ValueError(f"--attention-backend {backend!r} has no known efficiency on {family} GPUs; "
                         "give --attention-efficiency or --calibrate a gpu_check JSON")
    return ATTENTION[key]


@dataclasses.dataclass(frozen=True)
class Efficiencies:
    """The efficiencies a plan is timed with."""

    attention: Band  # one kernel call (``cp_factor`` = 1: already the in-step value)
    matmul: Band
    cp_factor: float = PLUGIN_CP_STEP_FACTOR  # share of ``attention`` a CP > 1 step keeps

    def point(self, which: str, cp: int = 1) -> tuple[float, float]:
        """In-step (attention, matmul) at ``which`` in ('low', 'expected', 'high') for a CP size."""
        attention = getattr(self.attention, which) * (self.cp_factor if cp > 1 else 1.0)
        return attention, getattr(self.matmul, which)


def default_efficiencies(family: str, backend: str, fp8: bool) -> Efficiencies:
    return Efficiencies(attention_band(family, backend), MATMUL_FP8 if fp8 else MATMUL_BF16,
                        CP_STEP_FACTOR.get((family, backend), PLUGIN_CP_STEP_FACTOR))


def resolve(family: str, backend: str, fp8: bool, *, attention: Optional[float] = None,
            matmul: Optional[float] = None, calibration: Optional["Calibration"] = None) -> Efficiencies:
    """Defaults, replaced by a calibration file, replaced by explicit flags (in that order)."""
    eff = default_efficiencies(family, backend, fp8)
    if calibration is not None:
        eff = calibration.apply(eff, backend, fp8)
    if attention is not None:  # an in-step value: no CP factor on top
        eff = dataclasses.replace(eff, attention=Band.fixed(attention, "--attention-efficiency"), cp_factor=1.0)
    if matmul is not None:
        eff = dataclasses.replace(eff, matmul=Band.fixed(matmul, "--matmul-efficiency"))
    return eff


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured rates from a ``gpu_check`` JSON (``scripts/gpu_check.py --out``)."""

    path: str
    peak_tflops: float  # dense bf16 peak of the GPU the file was measured on (plan's --bf16-tflops)
    matmul_tflops: Optional[float]  # measured bf16 GEMM rate
    attention_tflops: dict[str, float]  # backend -> fwd+bwd TFLOP/s of one kernel call (7·s²·H count)
    ring_efficiency: Optional[float]  # CP ring step time of one call over the same tokens / ring time

    def apply(self, eff: Efficiencies, backend: str, fp8: bool) -> Efficiencies:
        out = eff
        kernel = {"auto": ("flash_attn", "sdpa_cuda")}.get(backend, (_KERNEL_NAME.get(backend, backend),))
        for name in kernel:
            if name in self.attention_tflops:
                share = min(self.attention_tflops[name] / self.peak_tflops, 1.0)
                out = dataclasses.replace(out, attention=Band.fixed(share, f"measured {name} in {self.path}"))
                break
        if self.ring_efficiency is not None:
            out = dataclasses.replace(out, cp_factor=self.ring_efficiency)
        if self.matmul_tflops and not fp8:
            out = dataclasses.replace(out, matmul=Band.fixed(
                min(self.matmul_tflops / self.peak_tflops, 1.0),
                f"measured 8192^3 bf16 GEMM in {self.path} (an upper bound for the model's GEMMs)"))
        return out


_KERNEL_NAME = {"flash_attn2": "flash_attn", "flash_attn3": "flash_attn"}


def _fwd_bwd(fwd: float, bwd: float) -> float:
    """fwd+bwd TFLOP/s of a kernel from its forward and backward rates (backward = 2.5x the FLOPs)."""
    return 3.5 / (1 / fwd + 2.5 / bwd)


def _kernel_rates(kernels: dict) -> dict[str, float]:
    """backend -> fwd+bwd TFLOP/s from ``kernels.tflops.<backend>.<dtype>.{fwd, bwd}`` (bf16 first)."""
    rates: dict[str, float] = {}
    for name, by_dtype in (kernels.get("tflops") or {}).items():
        if not isinstance(by_dtype, dict):
            continue
        for dtype in ("bfloat16", "float16"):
            entry = by_dtype.get(dtype)
            if isinstance(entry, dict) and _positive(entry.get("fwd")) and _positive(entry.get("bwd")):
                rates[name] = _fwd_bwd(float(entry["fwd"]), float(entry["bwd"]))
                break
    return rates


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 0


def load_calibration(path: str, peak_tflops: float) -> Calibration:
    """Read measured rates from a ``gpu_check/2`` JSON; every error names ``--calibrate`` and the path.

    ``sections.environment.matmul_bf16_tflops`` (bf16 GEMM), ``sections.kernels.tflops.<backend>.
    <dtype>.{fwd, bwd}`` (one kernel call, causal 2·s²·H forward, 2.5× backward) and the causal rows'
    ``efficiency`` of ``sections.ring`` at the largest CP size (the CP-step factor).  Sections may be
    missing or skipped; a dry run (``--allow-cpu``) is refused.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
    except OSError as exc:
        raise ValueError(f"--calibrate {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--calibrate {path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(report, dict) or not isinstance(report.get("sections"), dict):
        raise ValueError(f"--calibrate {path}: not a gpu_check report (no 'sections'); "
                         "pass the JSON scripts/gpu_check.py --out wrote")
    if report.get("dry_run") or report.get("device") == "cpu":
        raise ValueError(f"--calibrate {path}: a dry run on the CPU measures nothing; run scripts/gpu_check.sh on "
                         "the GPU and pass its JSON")
    if report.get("schema") not in (None, "gpu_check/2"):
        raise ValueError(f"--calibrate {path}: schema {report.get('schema')!r} is not gpu_check/2")
    sections = report["sections"]
    env = sections.get("environment") or {}
    matmul = float(env["matmul_bf16_tflops"]) if _positive(env.get("matmul_bf16_tflops")) else None
    attention = _kernel_rates(sections.get("kernels") or {})
    ring = None
    rows = [r for r in (sections.get("ring") or {}).get("rows") or []
            if isinstance(r, dict) and r.get("layout", "causal") == "causal" and _positive(r.get("efficiency"))]
    if rows:
        ring = min(float(max(rows, key=lambda r: r.get("cp", 0))["efficiency"]), 1.0)
    if not attention and matmul is None:
        raise ValueError(f"--calibrate {path}: no measured rate in it (sections.kernels.tflops and "
                         "sections.environment.matmul_bf16_tflops are missing or skipped)")
    return Calibration(path, peak_tflops, matmul, attention, ring)
