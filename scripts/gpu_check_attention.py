"""gpu_check sections on attention: CUDA block kernels vs the reference; the ring's block schedule."""

from __future__ import annotations

from typing import Any

import torch

from gpu_check_common import Budget, Sizes, _rel_err, _time


def _kernel_case(kern, ref, case: tuple, device: torch.device, dtype: torch.dtype) -> dict:
    from megatron_longctx.kernels.base import BlockArgs, BlockMask

    b, s, hq, hkv, d, left = case
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=dtype, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(b, s, hq, d, device=device, dtype=dtype, generator=g)
    args = BlockArgs(softmax_scale=d ** -0.5, mask=BlockMask(causal=True, window=(left, -1)))
    reason = kern.check(q, k, v, args)
    if reason is not None:
        return {"case": list(case), "status": "unsupported", "reason": reason}
    out, lse = kern.forward(q, k, v, args)
    grads = kern.backward(dout, q, k, v, out, lse, args)
    r_out, r_lse = ref.forward(q, k, v, args)
    r_grads = ref.backward(dout, q, k, v, r_out, r_lse, args)
    errs = {"out": _rel_err(out, r_out), "lse": _rel_err(lse, r_lse)}
    errs.update({n: _rel_err(a, r) for n, a, r in zip(("dq", "dk", "dv"), grads, r_grads)})
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    return {"case": list(case), "status": "ok" if max(errs.values()) <= tol else "mismatch",
            "max_rel_err": errs, "tolerance": tol}


def _kernel_timing(kern, s: int, device: torch.device, dtype: torch.dtype, heads: tuple) -> dict:
    from megatron_longctx.kernels.base import BlockArgs, BlockMask

    hq, hkv, d = heads
    q, k, v = (torch.randn(1, s, h, d, device=device, dtype=dtype) for h in (hq, hkv, hkv))
    args = BlockArgs(softmax_scale=d ** -0.5, mask=BlockMask(causal=True))
    if kern.check(q, k, v, args) is not None:
        return {"status": "unsupported", "reason": kern.check(q, k, v, args)}
    out, lse = kern.forward(q, k, v, args)
    fwd = _time(lambda: kern.forward(q, k, v, args), device)
    bwd = _time(lambda: kern.backward(out, q, k, v, out, lse, args), device)
    flops = 2 * s * s * hq * d  # causal forward: 2·b·s²·H
    return {"seq": s, "fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3, "fwd_tflops": flops / fwd / 1e12,
            "bwd_tflops": 2.5 * flops / bwd / 1e12}


def section_kernels(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    from megatron_longctx.kernels.base import KernelUnsupported
    from megatron_longctx.kernels.select import get_kernel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ref = get_kernel("reference", device)
    names = ["sdpa_cuda", "flash_attn"] + (["cpu_flash"] if device.type == "cpu" else [])
    result: dict[str, Any] = {"dtype": str(dtype)}
    for name in names:
        try:
            kern = get_kernel(name, device)
        except KernelUnsupported as exc:
            result[name] = {"status": "skipped", "reason": str(exc)}
            continue
        cases = []
        for case in sizes.kernel_cases:
            if budget.left() <= 0:
                cases.append({"case": list(case), "status": "skipped", "reason": "time budget"})
                continue
            try:
                cases.append(_kernel_case(kern, ref, case, device, dtype))
            except Exception as exc:  # noqa: BLE001 - one case must not hide the others
                cases.append({"case": list(case), "status": "error", "error": f"{type(exc).__name__}: {exc}"})
        entry: dict[str, Any] = {"cases": cases}
        if budget.left() > 0:
            try:
                entry["timing"] = _kernel_timing(kern, sizes.kernel_timing_seq, device, dtype, sizes.heads)
            except Exception as exc:  # noqa: BLE001
                entry["timing"] = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        statuses = {c["status"] for c in cases}
        entry["status"] = "failed" if statuses & {"mismatch", "error"} else "ok"
        result[name] = entry
    if any(isinstance(v, dict) and v.get("status") == "failed" for v in result.values()):
        result["status"] = "failed"
    return result


# --------------------------------------------------------------------------------------------------
def _zigzag_chunks(rank: int, p: int) -> tuple[int, int]:
    """Chunks of the 2·P-way split that rank ``rank`` holds (Megatron's load-balanced layout)."""
    return rank, 2 * p - 1 - rank


def ring_schedule_forward(kern, q, k, v, p: int, scale: float) -> tuple[torch.Tensor, int]:
    """Every rank's ring forward, one after another: q/k/v ``[b, s, h, d]`` -> (out ``[b, s, hq, d]``, blocks).

    Rank r holds chunks (r, 2P-1-r); at step j it sees the K/V of rank (r - j) mod P and calls the
    kernel on each visible (query chunk, key chunk) pair, folding results with the online softmax.
    """
    from megatron_longctx.kernels.base import BlockArgs, BlockMask, Visibility
    from megatron_longctx.kernels.merge import merge_into

    s = q.shape[1]
    c = s // (2 * p)
    mask = BlockMask(causal=True)
    out = torch.empty_like(q[..., : v.shape[-1]])
    blocks = 0
    for rank in range(p):
        for qc in _zigzag_chunks(rank, p):
            acc_out = acc_lse = None
            for step in range(p):
                src = (rank - step) % p
                for kc in _zigzag_chunks(src, p):
                    if mask.visibility(qc * c, c, kc * c, c) is Visibility.NONE:
                        continue
                    args = BlockArgs(softmax_scale=scale, mask=mask, q_start=qc * c, k_start=kc * c)
                    o, lse = kern.forward(q[:, qc * c:(qc + 1) * c], k[:, kc * c:(kc + 1) * c],
                                          v[:, kc * c:(kc + 1) * c], args)  # [b, c, hq, d], [b, hq, c]
                    acc_out, acc_lse = merge_into(acc_out, acc_lse, o, lse)
                    blocks += 1
            out[:, qc * c:(qc + 1) * c] = acc_out.to(out.dtype)
    return out, blocks


def section_ring_overhead(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    from megatron_longctx.kernels.base import BlockArgs, BlockMask
    from megatron_longctx.kernels.select import get_kernel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kern = get_kernel(None, device)
    hq, hkv, d = sizes.heads
    s = sizes.ring_tokens
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, s, h, d, device=device, dtype=dtype, generator=g) for h in (hq, hkv, hkv))
    args = BlockArgs(softmax_scale=d ** -0.5, mask=BlockMask(causal=True))
    single_out, _ = kern.forward(q, k, v, args)
    t_single = _time(lambda: kern.forward(q, k, v, args), device)
    rows = []
    for p in sizes.ring_sizes:
        if budget.left() < 3 * t_single + 1:
            rows.append({"cp": p, "status": "skipped", "reason": "time budget"})
            continue
        out, blocks = ring_schedule_forward(kern, q, k, v, p, d ** -0.5)
        t_ring = _time(lambda: ring_schedule_forward(kern, q, k, v, p, d ** -0.5), device)
        rows.append({"cp": p, "tokens_per_rank": s // p, "blocks": blocks, "single_call_ms": t_single * 1e3,
                     "schedule_ms": t_ring * 1e3, "efficiency": t_single / t_ring,
                     "overhead_per_block_us": (t_ring - t_single) / blocks * 1e6,
                     "max_rel_err_vs_single_call": _rel_err(out, single_out)})
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    bad = [r for r in rows if r.get("max_rel_err_vs_single_call", 0.0) > tol]
    return {"backend": kern.name, "tokens": s, "heads": list(sizes.heads), "rows": rows,
            "status": "failed" if bad else "ok", "note": "forward only; one GPU runs the P ranks' blocks in turn"}
