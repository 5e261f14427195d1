"""gpu_check section ``packed``: the packed (THD) ring as training runs it, on one device.

Every rank of a ring of P is simulated in turn: its shard of the packed batch (:func:`megatron_longctx.
attention.shard_packed`), the ring schedule of the packed layout (:func:`megatron_longctx.attention.schedule.
ring_schedule`), and per ring step one many-document call (:func:`~megatron_longctx.attention.block_loop.
attend_first` / ``attend_segments`` and ``attend_segments_backward``, as :mod:`megatron_longctx.attention.ring`
makes them), sinks added to the merged result (:mod:`megatron_longctx.attention.sinks`).  Documents of mixed
lengths (many kernel tiles long), GQA, causal and sliding-window masks; out, lse (nats), dq, dk, dv and the
sinks' gradient against a float64 softmax with the sink column, per document.  The kernel calls each ring
step makes are counted: a backend with variable-length calls must serve a step in one call per piece kind
and direction (at most 3 for causal documents).

On the CPU (the dry run) the rows run ``cpu_flash`` and the CUDA backends' variable-length paths over the
CPU emulations of their exact op schemas (torch's flash ops; flash-attn 2.5 and 2.8; FlashAttention-3).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from gpu_check_common import BUDGET, ERROR, FAILED, OK, Budget, Sizes, _abs_err, _rel_err, _time, verdict

MAX_CALLS_PER_STEP = 3  # per direction, for a backend with variable-length calls


def _backends(device: torch.device) -> dict[str, Any]:
    """name -> a context manager that makes ``select.BACKENDS`` serve it (the real module on a GPU, emulated
    ops on the CPU) and whether it has variable-length calls."""
    from gpu_check_attention import kernel_backends

    if device.type == "cuda":
        return {n: (contextlib.nullcontext, n, True) for n in kernel_backends(device)[0]}
    out = {"cpu_flash": (contextlib.nullcontext, "cpu_flash", False)}
    for label, factory in _emulated().items():
        out[label] = (functools.partial(_installed, *factory), factory[0], True)
    return out


def _emulated() -> dict[str, tuple]:
    from megatron_longctx.kernels import sdpa_cuda
    from tests.kernels import flash_attn_releases as releases
    from tests.kernels import flash_emulation

    return {"sdpa_cuda~emulated": ("sdpa_cuda", lambda: sdpa_cuda.FlashOpPieces(
                flash_emulation.flash_forward, flash_emulation.flash_backward, True)),
            "flash_attn-2.5.0~emulated": ("flash_attn", lambda: releases.fa2_kernel("2.5.0")),
            "flash_attn-2.8.3~emulated": ("flash_attn", lambda: releases.fa2_kernel("2.8.3")),
            "flash_attn-3~emulated": ("flash_attn", releases.fa3_kernel)}


@contextlib.contextmanager
def _installed(name: str, make):
    """``select.BACKENDS[name]`` served by piece kernel ``make()`` on CPU tensors (production arithmetic)."""
    from megatron_longctx.kernels import select
    from tests.kernels.flash_emulation import emulated_backend

    fake = emulated_backend(name, make())
    saved = select.BACKENDS[name]
    select.BACKENDS[name] = fake
    try:
        yield
    finally:
        select.BACKENDS[name] = saved


class _CallCounter:
    """Counts the kernel calls of each ring step: every variable-length call (``kernels.varlen``) and every
    single-block call a backend makes outside it."""

    def __init__(self):
        self.n = 0

    @contextlib.contextmanager
    def installed(self, backend_name: str):
        from megatron_longctx.kernels import select, varlen

        saved = varlen.varlen_forward, varlen.varlen_backward
        module = select.BACKENDS[backend_name]
        saved_block = module.forward, module.backward

        def counted(fn):
            @functools.wraps(fn)
            def call(*args, **kwargs):
                self.n += 1
                return fn(*args, **kwargs)
            return call

        def wrap_varlen(fn):
            @functools.wraps(fn)
            def inner(call, *args, **kwargs):
                return fn(counted(call), *args, **kwargs)
            return inner

        varlen.varlen_forward, varlen.varlen_backward = wrap_varlen(saved[0]), wrap_varlen(saved[1])
        module.forward, module.backward = counted(saved_block[0]), counted(saved_block[1])
        try:
            yield
        finally:
            varlen.varlen_forward, varlen.varlen_backward = saved
            module.forward, module.backward = saved_block

    def take(self) -> int:
        n, self.n = self.n, 0
        return n


def _ring(q, k, v, dout, sink, packing, cp: int, mask, scale: float, backend: str, counter: _CallCounter):
    """The packed ring of ``cp`` ranks, rank by rank: padded global out, lse, dq, dk, dv and the sinks' grad."""
    from megatron_longctx.attention import schedule
    from megatron_longctx.attention.block_loop import (GradSum, Rows, attend_first, attend_segments,
                                                       attend_segments_backward)
    from megatron_longctx.attention.layout import SeqLayout
    from megatron_longctx.attention.packed_sharding import gather_packed_shards, shard_packed
    from megatron_longctx.attention.sinks import add_sink, sink_grad

    plan = schedule.ring_schedule(SeqLayout(packing, cp), mask)
    kinds = [_kinds(plan.calls[i][r], scale) for r in range(cp) for i in range(len(plan.offsets))]
    shard = [[shard_packed(x, packing, r, cp)[None] for r in range(cp)] for x in (q, k, v, dout)]  # [1, T/P, h, d]
    qs, ks, vs, dos = shard
    outs, lses, fwd_calls = [], [], []
    for r in range(cp):
        out = lse = None
        for i, off in enumerate(plan.offsets):
            j = (r - off) % cp  # the K/V rank r holds at step i
            if out is None:
                out, lse = attend_first(qs[r], ks[j], vs[j], plan.calls[i][r], scale, backend)
            else:
                attend_segments(qs[r], ks[j], vs[j], plan.calls[i][r], scale, backend, out, lse)
            fwd_calls.append(counter.take())
        out, lse = add_sink(out.to(q.dtype), lse, sink)  # the sinks once, on the merged result
        outs.append(out)
        lses.append(lse)
    acc = lses[0].dtype
    dk_acc = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in ks]
    dv_acc = [torch.zeros(x.shape, dtype=acc, device=x.device) for x in vs]
    dqs, dsink, bwd_calls = [], torch.zeros_like(sink), []
    for r in range(cp):
        dq = GradSum([qs[r].shape], acc, q.device)
        for i, off in enumerate(plan.offsets):
            j = (r - off) % cp
            dkv = GradSum([ks[j].shape, vs[j].shape], acc, q.device)
            attend_segments_backward(Rows(qs[r], outs[r], lses[r], dos[r]), ks[j], vs[j], plan.calls[i][r], scale,
                                     backend, dq, dkv)
            bwd_calls.append(counter.take())
            dk_j, dv_j = dkv.result()
            dk_acc[j] += dk_j
            dv_acc[j] += dv_j
        dqs.append(dq.result()[0])
        dsink += sink_grad(dos[r], outs[r], lses[r], sink)

    def whole(parts):  # [1, T/P, ...] per rank -> [T, ...] padded global order
        return gather_packed_shards([p[0] for p in parts], packing)

    lse_t = [x.transpose(1, 2) for x in lses]  # [1, h, T/P] -> [1, T/P, h]
    grads = [whole(dqs), whole(dk_acc), whole(dv_acc)]
    return whole(outs), whole(lse_t), grads, dsink, (fwd_calls, bwd_calls, kinds), len(plan.offsets)


def _kinds(calls, scale: float) -> int:
    """Piece kinds of one step's calls (:func:`megatron_longctx.kernels.varlen.group_pieces`): what a backend
    with variable-length calls needs one call each for."""
    from megatron_longctx.kernels import driver, varlen
    from megatron_longctx.kernels.base import BlockArgs

    blocks = [varlen.Block(c.q_lo, c.q_hi, c.k_lo, c.k_hi, BlockArgs(scale, c.mask, c.q_start, c.k_start))
              for c in calls]
    return len(varlen.group_pieces(blocks, driver.flash2_pieces))


def _reference(q, k, v, dout, sink, lengths, mask, scale):
    """float64, document by document: out ``[N, hq, d]``, lse ``[N, hq]`` (with the sink), dq, dk, dv, dsink."""
    q, k, v, sink = (x.detach().double().requires_grad_() for x in (q, k, v, sink))
    g = q.shape[1] // k.shape[1]
    outs, lses, at = [], [], 0
    for n in lengths:
        rows = slice(at, at + n)
        at += n
        kx, vx = (x[rows].repeat_interleave(g, dim=1) for x in (k, v))  # [n, hq, d]
        s = torch.einsum("qhd,khd->hqk", q[rows], kx) * scale
        s = s.masked_fill(~mask.dense(0, n, 0, n, q.device), float("-inf"))
        s = torch.cat([s, sink.view(-1, 1, 1).expand(-1, n, 1)], dim=-1)  # [hq, n, n + 1]: the sink column
        lses.append(torch.logsumexp(s, dim=-1).transpose(0, 1))  # [n, hq]
        p = torch.softmax(s, dim=-1)[..., :n]
        outs.append(torch.einsum("hqk,khd->qhd", p, vx))
    out, lse = torch.cat(outs), torch.cat(lses)
    (out * dout.double()).sum().backward()
    return out.detach(), lse.detach(), [q.grad, k.grad, v.grad], sink.grad


def _row(label: str, backend: str, varlen: bool, kind: str, cp: int, data: dict, ref: dict, mask) -> dict:
    from megatron_longctx.attention import Packing
    from megatron_longctx.attention.packed_sharding import pad_packed, unpad_packed

    lengths, scale = data["lengths"], data["scale"]
    packing = Packing.from_lengths(lengths, cp)
    q, k, v, dout = (pad_packed(data[n], packing) for n in ("q", "k", "v", "dout"))
    counter = _CallCounter()
    with counter.installed(backend):
        out, lse, grads, dsink, (fwd_calls, bwd_calls, kinds), steps = _ring(q, k, v, dout, data["sink"], packing, cp, mask,
                                                                     scale, backend, counter)
    got = {"out": unpad_packed(out, packing), "lse": unpad_packed(lse, packing)}
    got.update({n: unpad_packed(g, packing) for n, g in zip(("dq", "dk", "dv"), grads)})
    got["dsink"] = dsink
    errs = {n: (_abs_err if n == "lse" else _rel_err)(got[n], ref[n]) for n in got}
    lowp = q.dtype in (torch.bfloat16, torch.float16)
    tol = {"rel": 2e-2 if lowp else 1e-4, "lse_nats": 1e-2 if lowp else 1e-4}
    within = all(e <= (tol["lse_nats"] if n == "lse" else tol["rel"]) for n, e in errs.items())
    # one call per piece kind and direction; causal layouts have two kinds (causal, unmasked), windows one
    # more per window geometry (flash-attn's windows are relative to each sequence's bottom-right corner)
    bound = [k if mask.left >= 0 else min(k, MAX_CALLS_PER_STEP) for k in kinds]
    calls_ok = not varlen or all(f <= b and w <= b for f, w, b in zip(fwd_calls, bwd_calls, bound))
    row_timing = _per_pair(data, cp, mask, backend) if q.device.type == "cuda" else {}
    return {**row_timing, "backend": label, "layout": kind, "cp": cp, "documents": len(lengths), "steps": steps,
            "max_err": errs, "tolerance": tol, "max_forward_calls_per_step": max(fwd_calls),
            "max_backward_calls_per_step": max(bwd_calls), "max_kinds_per_step": max(kinds), "calls_bounded": calls_ok,
            "status": OK if within and calls_ok else FAILED}


def _per_pair(data: dict, cp: int, mask, backend: str) -> dict:
    """Seconds per visible pair of the packed ring's forward+backward, and of one document of the same tokens
    (the dense layout) through the same ring: the cost of packing (reported, not judged)."""
    from megatron_longctx.attention import Packing
    from megatron_longctx.attention.packed_sharding import pad_packed
    from megatron_longctx.attention.segments import visible_pairs

    out = {}
    for name, lengths in (("packed", data["lengths"]), ("dense", (sum(data["lengths"]),))):
        packing = Packing.from_lengths(lengths, cp)
        q, k, v, dout = (pad_packed(data[n], packing) for n in ("q", "k", "v", "dout"))
        counter = _CallCounter()
        seconds = _time(lambda: _ring(q, k, v, dout, data["sink"], packing, cp, mask, data["scale"], backend,
                                      counter), q.device, reps=2)
        pairs = sum(visible_pairs(mask, 0, n, 0, n) for n in lengths)
        out[f"{name}_ns_per_kpair"] = seconds / pairs * 1e12
    out["packed_over_dense_per_pair"] = out["packed_ns_per_kpair"] / out["dense_ns_per_kpair"]
    return out


def section_packed(device: torch.device, sizes: Sizes, budget: Budget) -> dict:
    """Must cover: every backend x (causal, window) x ring size, each with sinks, GQA and mixed lengths."""
    from megatron_longctx.kernels.base import BlockMask

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hq, hkv, d = sizes.packed_heads
    lengths = sizes.packed_lengths
    n = sum(lengths)
    gen = torch.Generator(device=device).manual_seed(0)
    data = {name: torch.randn(n, h, d, device=device, dtype=dtype, generator=gen)
            for name, h in (("q", hq), ("k", hkv), ("v", hkv), ("dout", hq))}
    data.update(lengths=lengths, scale=d ** -0.5,
                sink=torch.randn(hq, device=device, dtype=torch.float32, generator=gen))
    masks = {"causal+sinks": BlockMask(causal=True), "window+sinks": BlockMask(causal=True,
                                                                               window=(sizes.packed_window, 0))}
    backends = _backends(device)
    rows: list[dict] = []
    for kind, mask in masks.items():
        r_out, r_lse, r_grads, r_dsink = _reference(data["q"], data["k"], data["v"], data["dout"], data["sink"],
                                                    lengths, mask, data["scale"])
        ref = {"out": r_out, "lse": r_lse, "dq": r_grads[0], "dk": r_grads[1], "dv": r_grads[2], "dsink": r_dsink}
        for label, (context, backend, varlen) in backends.items():
            for cp in sizes.packed_cp:
                if budget.left() <= 0:
                    rows.append({"backend": label, "layout": kind, "cp": cp, "status": BUDGET, "reason": "time budget"})
                    continue
                try:
                    with context():
                        rows.append(_row(label, backend, varlen, kind, cp, data, ref, mask))
                except Exception as exc:  # noqa: BLE001 - one row must not hide the others
                    rows.append({"backend": label, "layout": kind, "cp": cp, "status": ERROR,
                                 "error": f"{type(exc).__name__}: {exc}"})
        del ref, r_grads
    must = len(masks) * len(backends) * len(sizes.packed_cp)
    return {"status": verdict(rows, must), "must_cover": must, "dtype": str(dtype), "tokens": n,
            "documents": len(lengths), "heads": list(sizes.packed_heads), "rows": rows}
