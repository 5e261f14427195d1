"""gpu_check sections on attention: every kernel case against the float64 reference; the real ring
schedule of P ranks (causal, windowed, packed) run block by block on one device against one call.

The ring's calls come from the public pieces only: the shards of :func:`megatron_longctx.attention.
shard_sequence` / :func:`~megatron_longctx.attention.shard_packed` (which global positions each rank
holds) and :func:`megatron_longctx.attention.segments.schedule_blocks` over (rank ``r``'s query segments,
rank ``r - t``'s key segments) for every offset ``t`` — what the ring runs — then
:func:`~megatron_longctx.attention.block_loop.attend_segments` (+ ``_backward``).  The schedule's pair
count is checked against :func:`~megatron_longctx.attention.schedule_flops` and the exact number of
visible pairs, so a block computed twice or skipped shows up even where the numbers would hide it.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_check_common import BUDGET, ERROR, FAILED, OK, Budget, Sizes, _abs_err, _rel_err, _time, verdict, worst


def _dtypes(device: torch.device) -> tuple:
    return (torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float32,)


def _tol(dtype: torch.dtype) -> float:
    """Relative tolerance of outputs and gradients against float64 on the same rounded inputs."""
    return 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4


def _lse_tol(dtype: torch.dtype) -> float:
    """Absolute tolerance of lse, in nats (the kernels form it in float32 from exact products of the inputs)."""
    return 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4


def _errors(got: dict, want: dict) -> dict:
    """Per tensor: relative error, lse in absolute nats; NaN or a wrong-signed inf anywhere is ``inf``."""
    return {name: (_abs_err if name == "lse" else _rel_err)(a, want[name]) for name, a in got.items()}


def _within(errs: dict, dtype: torch.dtype) -> bool:
    """Every error within its tolerance (a NaN compares False, so it fails too)."""
    return all(e <= (_lse_tol(dtype) if name == "lse" else _tol(dtype)) for name, e in errs.items())


def _tolerances(dtype: torch.dtype) -> dict:
    return {"rel": _tol(dtype), "lse_nats": _lse_tol(dtype)}


def _case(kern, ref, case, device: torch.device, dtype: torch.dtype) -> dict:
    from tests.kernels.cases import make_inputs

    q, k, v, dout = (t.to(device) for t in make_inputs(case, torch.float64))
    args = case.args()
    lo = [t.to(dtype) for t in (q, k, v, dout)]
    reason = kern.check(*lo[:3], args)
    if reason is not None:
        return {"case": case.name, "status": "unsupported", "reason": reason}
    out, lse = kern.forward(*lo[:3], args)
    grads = kern.backward(lo[3], *lo[:3], out, lse, args)
    qd, kd, vd, dd = (t.double() for t in lo)  # the float64 oracle sees the same rounded values
    r_out, r_lse = ref.forward(qd, kd, vd, args)
    r_grads = ref.backward(dd, qd, kd, vd, r_out, r_lse, args)
    errs = _errors({"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]},
                   {"out": r_out, "lse": r_lse, "dq": r_grads[0], "dk": r_grads[1], "dv": r_grads[2]})
    return {"case": case.name, "status": "ok" if _within(errs, dtype) else "mismatch",
            "max_err": errs, "tolerance": _tolerances(dtype)}


def _timing(kern, s: int, device: torch.device, dtype: torch.dtype, heads: tuple) -> dict:
    from megatron_longctx.kernels.base import BlockArgs, BlockMask

    hq, hkv, d = heads
    q, k, v = (torch.randn(1, s, h, d, device=device, dtype=dtype) for h in (hq, hkv, hkv))
    args = BlockArgs(softmax_scale=d ** -0.5, mask=BlockMask(causal=True))
    reason = kern.check(q, k, v, args)
    if reason is not None:
        return {"status": "unsupported", "reason": reason}
    out, lse = kern.forward(q, k, v, args)
    fwd = _time(lambda: kern.forward(q, k, v, args), device)
    bwd = _time(lambda: kern.backward(out, q, k, v, out, lse, args), device)
    flops = 2 * s * s * hq * d  # causal forward: half of 4·s²·h·d
    return {"seq": s, "heads": list(heads), "fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3,
            "fwd": flops / fwd / 1e12, "bwd": 2.5 * flops / bwd / 1e12}


def kernel_backends(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The backends a section must cover on ``device``, and those it need not (with why): on a GPU
    ``sdpa_cuda`` always and ``flash_attn`` unless its package is absent (installed but refused is a
    failure, not a skip); on the CPU ``cpu_flash``."""
    from megatron_longctx.kernels import flash_attn

    if device.type != "cuda":
        return ["cpu_flash"], {"sdpa_cuda": "needs CUDA", "flash_attn": "needs CUDA"}
    reason = flash_attn.available(device)
    if reason == "flash-attn is not installed" and isinstance(flash_attn._fa3(), str):
        return ["sdpa_cuda"], {"flash_attn": reason}
    return ["sdpa_cuda", "flash_attn"], {}


def section_kernels(device: torch.device, sizes: Sizes, budget: Budget, cases=None) -> dict:
    """Must cover: every case of ``cases`` (all of ``tests/kernels/cases.py``) in every dtype on every backend
    of :func:`kernel_backends`; "ok" only when all of them ran and passed."""
    from megatron_longctx.kernels.base import KernelUnsupported
    from megatron_longctx.kernels.select import get_kernel
    from tests.kernels.cases import CASES

    cases_run = CASES if cases is None else [c for c in CASES if c.name in cases]
    ref = get_kernel("reference", device)
    names, not_here = kernel_backends(device)
    backends: dict[str, Any] = {}
    tflops: dict[str, Any] = {}
    for name in names:
        try:
            kern = get_kernel(name, device)
        except KernelUnsupported as exc:
            backends[name] = {"status": FAILED, "reason": f"required here but refused: {exc}"}
            continue
        entry: dict[str, Any] = {}
        all_cases = []
        for dtype in _dtypes(device):
            cases = []
            for case in cases_run:
                if budget.left() <= 0:
                    cases.append({"case": case.name, "status": BUDGET, "reason": "time budget"})
                    continue
                try:
                    cases.append(_case(kern, ref, case, device, dtype))
                except Exception as exc:  # noqa: BLE001 - one case must not hide the others
                    cases.append({"case": case.name, "status": ERROR, "error": f"{type(exc).__name__}: {exc}"})
            per = {"cases": cases}
            if budget.left() > 0:
                try:
                    per["timing"] = _timing(kern, sizes.kernel_timing_seq, device, dtype, sizes.heads)
                    if "fwd" in per["timing"]:
                        tflops.setdefault(name, {})[str(dtype).replace("torch.", "")] = {
                            k: per["timing"][k] for k in ("fwd", "bwd", "seq", "heads")}
                except Exception as exc:  # noqa: BLE001
                    per["timing"] = {"status": ERROR, "error": f"{type(exc).__name__}: {exc}"}
            entry[str(dtype).replace("torch.", "")] = per
            all_cases += cases
        entry["status"] = verdict(all_cases, len(cases_run) * len(_dtypes(device)))
        entry["bad_cases"] = [f"{c['case']}: {c['status']}" for c in all_cases if c["status"] not in (OK, "unsupported")]
        backends[name] = entry
    status = verdict(list(backends.values()), len(names))
    return {"status": status, "must_cover": {n: len(cases_run) * len(_dtypes(device)) for n in names},
            "not_here": not_here, "cases": len(cases_run), "tflops": tflops, "backends": backends}


# --------------------------------------------------------------------------------------------------
def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs ``(start, length)`` of ``positions`` in the order they appear."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return [(a, n) for a, n in runs]


def _rank_docs(held: list[int], docs: list[tuple[int, int]]) -> list[tuple[int, list[int], tuple]]:
    """Per document ``(start, length)`` (global positions): (doc, local rows, doc-relative segments)."""
    from megatron_longctx.attention.segments import Segment

    out = []
    for d, (start, length) in enumerate(docs):
        rows = [i for i, p in enumerate(held) if start <= p < start + length]
        segs = tuple(Segment(a - start, n) for a, n in _runs([held[i] for i in rows]))
        out.append((d, rows, segs))
    return out


def _layout(kind: str, s: int, p: int, mask) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Global positions each rank holds, and the documents ``(start, length)``."""
    from megatron_longctx.attention import Packing, shard_packed, shard_sequence

    if kind != "packed":
        index = torch.arange(s)
        return [shard_sequence(index, r, p, 0).tolist() for r in range(p)], [(0, s)]
    lengths = [s // 2 - 3 * p, s // 4 + p, s // 8 + 2 * p - 1, s // 8 - 5]  # uneven, padded per document
    packing = Packing.from_lengths(lengths, p)
    padded = packing.cu_seqlens_padded
    index = torch.arange(padded[-1])
    docs = [(padded[i], lengths[i]) for i in range(len(lengths))]
    return [shard_packed(index, packing, r, p, 0).tolist() for r in range(p)], docs


def _schedule(kind: str, s: int, p: int, mask) -> tuple[list, list, list, int]:
    """Every rank's ring calls: ``steps[t][r]`` = [(q rows, k rows, calls)] per document; pairs."""
    from megatron_longctx.attention.segments import schedule_blocks

    held, docs = _layout(kind, s, p, mask)
    per_rank = [_rank_docs(h, docs) for h in held]
    steps, pairs = [], 0
    for t in range(p):
        step = []
        for r in range(p):
            calls = []
            for (d, q_rows, q_segs), (_, k_rows, k_segs) in zip(per_rank[r], per_rank[(r - t) % p]):
                if q_segs and k_segs:
                    blocks = schedule_blocks(q_segs, k_segs, mask)
                    pairs += sum(c.pairs for c in blocks)
                    calls.append((q_rows, k_rows, blocks))
            step.append(calls)
        steps.append(step)
    return held, docs, steps, pairs


def _rows(rows: list[int], device: torch.device):
    """A slice when ``rows`` are contiguous (a view: in-place merges land), else an index tensor."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return torch.tensor(rows, device=device)


def _device_plan(held, steps, device):
    """Index tensors built once, outside the timed runs: per rank its global rows, per step its calls."""
    held_t = [torch.tensor(h, device=device) for h in held]
    plan = [[[(_rows(q_rows, device), _rows(k_rows, device), calls) for q_rows, k_rows, calls in step[r]]
             for step in steps] for r in range(len(held))]
    return held_t, plan


def _run_ring(q, k, v, plan, scale, backend, dout=None):
    """Run every rank's ring steps in turn; returns out, lse (and grads) in global order."""
    from megatron_longctx.attention.block_loop import (GradSum, Rows, attend_segments, attend_segments_backward,
                                                       new_accumulators)

    held, steps = plan
    p = len(held)
    out = torch.zeros(*q.shape[:3], v.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), device=q.device)
    for r in range(p):
        q_r = q[:, held[r]]  # [b, s/P, hq, d] this rank's queries
        acc_o, acc_l = new_accumulators(q_r, v.shape[3])
        for t, calls_t in enumerate(steps[r]):
            k_idx = held[(r - t) % p]
            k_r, v_r = k[:, k_idx], v[:, k_idx]  # [b, s/P, hkv, d] the K/V rank r holds at step t
            for qs, ks, calls in calls_t:
                o_view, l_view = acc_o[:, qs], acc_l[:, :, qs]
                attend_segments(q_r[:, qs], k_r[:, ks], v_r[:, ks], calls, scale, backend, o_view, l_view)
                if not isinstance(qs, slice):
                    acc_o[:, qs], acc_l[:, :, qs] = o_view, l_view
        out[:, held[r]], lse[:, :, held[r]] = acc_o.float(), acc_l.float()
    if dout is None:
        return out, lse, None
    grads = [torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v)]
    o_lo = out.to(q.dtype)
    for r in range(p):  # backward with the final out / lse of every row (what the ring's backward uses)
        q_idx = held[r]
        for t, calls_t in enumerate(steps[r]):
            k_idx = held[(r - t) % p]
            for qs, ks, calls in calls_t:
                qi, ki = q_idx[qs], k_idx[ks]  # global rows of this call group
                dq_sum, dkv_sum = (GradSum([(q.shape[0], len(x), y.shape[2], y.shape[3]) for y in ys],
                                           torch.float32, q.device) for x, ys in ((qi, (q,)), (ki, (k, v))))
                rows = Rows(q[:, qi], o_lo[:, qi], lse[:, :, qi].contiguous(), dout[:, qi])
                attend_segments_backward(rows, k[:, ki], v[:, ki], calls, scale, backend, dq_sum, dkv_sum)
                (dq,), (dk, dv) = dq_sum.result(), dkv_sum.result()
                grads[0][:, qi] += dq
                grads[1][:, ki] += dk
                grads[2][:, ki] += dv
    return out, lse, grads


def _single(kern, q, k, v, docs, mask, scale, dout):
    """One kernel call per document over its tokens in natural order (one call for unpacked layouts)."""
    from megatron_longctx.kernels.base import BlockArgs

    out = torch.zeros(*q.shape[:3], v.shape[3], dtype=q.dtype, device=q.device)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    args = BlockArgs(softmax_scale=scale, mask=mask)
    for start, n in docs:
        sl = slice(start, start + n)
        o, lse = kern.forward(q[:, sl], k[:, sl], v[:, sl], args)
        out[:, sl] = o
        if dout is not None:
            for g, x in zip(grads, kern.backward(dout[:, sl], q[:, sl], k[:, sl], v[:, sl], o, lse, args)):
                g[:, sl] = x
    return out, grads


def _ring_row(kern, kind: str, p: int, q, k, v, dout, mask, s: int, t_single_cache: dict) -> dict:
    from megatron_longctx.attention import schedule_flops
    from megatron_longctx.attention.segments import visible_pairs

    d = q.shape[3]
    scale = d ** -0.5
    held, docs, steps, pairs = _schedule(kind, s, p, mask)
    exact = sum(visible_pairs(mask, 0, n, 0, n) for _, n in docs)
    row: dict[str, Any] = {"layout": kind, "cp": p, "calls": sum(len(c[2]) for st in steps for r in st for c in r),
                           "pairs": pairs, "exact_pairs": exact}
    if kind != "packed":
        flops = sum(schedule_flops("ring", p, s, causal=mask.causal, window_size=mask.window, d_qk=d))
        row["schedule_flops_agree"] = flops == 4 * d * pairs
    plan = _device_plan(held, steps, q.device)
    out, lse, grads = _run_ring(q, k, v, plan, scale, kern.name, dout)
    ref_out, ref_grads = _single(kern, q, k, v, docs, mask, scale, dout)
    real = torch.tensor([i for a, n in docs for i in range(a, a + n)], device=q.device)
    errs = {"out": _rel_err(out[:, real], ref_out[:, real])}  # lse: the packed section compares it
    errs.update({n: _rel_err(g[:, real], r[:, real]) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    row["max_err"] = errs
    key = (kind, p if kind == "packed" else 0)  # packed documents depend on P (padding per document)
    if key not in t_single_cache:
        t_single_cache[key] = _time(lambda: _single(kern, q, k, v, docs, mask, scale, None), q.device)
    t_ring = _time(lambda: _run_ring(q, k, v, plan, scale, kern.name), q.device, reps=2)
    row.update(single_call_ms=t_single_cache[key] * 1e3, schedule_ms=t_ring * 1e3,
               efficiency=t_single_cache[key] / t_ring)
    ok = pairs == exact and row.get("schedule_flops_agree", True) and _within(errs, q.dtype)
    row["status"] = OK if ok else FAILED
    return row


def section_ring(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    from megatron_longctx.kernels.base import BlockMask
    from megatron_longctx.kernels.select import get_kernel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kern = get_kernel(None, device)
    hq, hkv, d = sizes.heads
    s = sizes.ring_tokens
    g = torch.Generator(device=device).manual_seed(0)
    n = s + 8 * max(sizes.ring_sizes)  # room for the packed layout's per-document padding
    q_all, k_all, v_all = (torch.randn(1, n, h, d, device=device, dtype=dtype, generator=g) for h in (hq, hkv, hkv))
    dout_all = torch.randn(1, n, hq, d, device=device, dtype=dtype, generator=g)
    masks = {"causal": BlockMask(causal=True), "window": BlockMask(causal=True, window=(s // 16, -1)),
             "packed": BlockMask(causal=True)}
    rows, cache = [], {}
    for kind, mask in masks.items():
        for p in sizes.ring_sizes:
            if budget.left() <= 0:
                rows.append({"layout": kind, "cp": p, "status": BUDGET, "reason": "time budget"})
                continue
            m = n if kind == "packed" else s
            q, k, v, dout = (t[:, :m] for t in (q_all, k_all, v_all, dout_all))
            try:
                rows.append(_ring_row(kern, kind, p, q, k, v, dout, mask, s, cache))
            except Exception as exc:  # noqa: BLE001 - one layout must not hide the others
                rows.append({"layout": kind, "cp": p, "status": ERROR, "error": f"{type(exc).__name__}: {exc}"})
    must = len(masks) * len(sizes.ring_sizes)
    return {"backend": kern.name, "tokens": s, "heads": list(sizes.heads), "dtype": str(dtype), "rows": rows,
            "status": verdict(rows, must), "must_cover": must,
            "note": "one device runs the P ranks' blocks in turn; efficiency = one call / the whole schedule"}


def _window_block(kern, s: int, window: int, device: torch.device, dtype: torch.dtype, heads: tuple) -> dict:
    from megatron_longctx.kernels import driver
    from megatron_longctx.kernels.base import BlockArgs, BlockMask

    hq, hkv, d = heads
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, s, h, d, device=device, dtype=dtype, generator=gen) for h in (hq, hkv, hkv, hq))
    args = BlockArgs(softmax_scale=d ** -0.5, mask=BlockMask(causal=True, window=(window, 0)))
    reason = kern.check(q, k, v, args)
    if reason is not None:
        return {"seq": s, "status": "unsupported", "reason": reason}
    out, lse = kern.forward(q, k, v, args)
    fwd = _time(lambda: kern.forward(q, k, v, args), device)
    bwd = _time(lambda: kern.backward(dout, q, k, v, out, lse, args), device)
    pieces = driver.pieces_for(args, s, s)
    return {"seq": s, "window": window, "fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3,
            "us_per_token": (fwd + bwd) / s * 1e6, "tiles": len(pieces),
            "keys_per_row": sum(p.s_q * p.s_k for p in pieces) / s,
            "inputs": (q, k, v, dout, args, out, lse)}


def section_windows(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    """Sliding windows in linear time: a windowed diagonal block at two lengths (4x apart) on each GPU
    backend (native window arguments, one call) and on the float32 reference (row tiles of the band),
    numerics of the longer one against the reference, and time per token at both lengths.

    Linear means 4x the tokens keeps the cost per token within 1.5x (quadratic would be 4x): on a GPU
    the measured time per token; on the CPU dry run, whose sub-millisecond timings are noise, the keys
    the row tiles score per query row."""
    from megatron_longctx.kernels.base import KernelUnsupported
    from megatron_longctx.kernels.select import get_kernel

    s_short = sizes.kernel_timing_seq
    lengths, window = (s_short, 4 * s_short), max(16, s_short // 4)
    ref = get_kernel("reference", device)
    names, not_here = kernel_backends(device)
    backends: dict[str, Any] = {}
    dtype = _dtypes(device)[0]
    for name in names:
        if budget.left() <= 0:
            backends[name] = {"status": BUDGET, "reason": "time budget"}
            continue
        try:
            kern = get_kernel(name, device)
        except KernelUnsupported as exc:
            backends[name] = {"status": FAILED, "reason": f"required here but refused: {exc}"}
            continue
        rows = [_window_block(kern, s, window, device, dtype, sizes.heads) for s in lengths]
        entry: dict[str, Any] = {"status": OK, "dtype": str(dtype).replace("torch.", "")}
        if any(r.get("status") == "unsupported" for r in rows):
            backends[name] = {"status": FAILED, "reason": "windows must be served: " + str(
                rows[0].get("reason") or rows[1].get("reason"))}
            continue
        q, k, v, dout, args, out, lse = rows[-1].pop("inputs")
        rows[0].pop("inputs")
        grads = kern.backward(dout, q, k, v, out, lse, args)
        qf, kf, vf, df = (t.float() for t in (q, k, v, dout))  # the reference sees the same rounded values
        r_out, r_lse = ref.forward(qf, kf, vf, args)
        r_grads = ref.backward(df, qf, kf, vf, r_out, r_lse, args)
        errs = _errors({"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]},
                       {"out": r_out, "lse": r_lse, "dq": r_grads[0], "dk": r_grads[1], "dv": r_grads[2]})
        growth = rows[1]["us_per_token"] / rows[0]["us_per_token"]
        key_growth = rows[1]["keys_per_row"] / rows[0]["keys_per_row"]
        entry.update(rows=rows, max_err=errs, tolerance=_tolerances(dtype), us_per_token_growth=growth,
                     keys_per_row_growth=key_growth)
        if not _within(errs, dtype):
            entry["status"] = "mismatch"
        elif not (growth if device.type == "cuda" else key_growth) <= 1.5:
            entry["status"] = "superlinear"
        backends[name] = entry
    return {"status": verdict(list(backends.values()), len(names)), "must_cover": names, "not_here": not_here,
            "lengths": list(lengths), "window": window, "backends": backends}
