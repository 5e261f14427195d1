"""The block loop: runs the block calls of :mod:`.segments` and folds their partial results with the online
softmax (FlashAttention); its backward runs the same calls.  Each backend receives all of its calls of a step
at once (:mod:`megatron_longctx.kernels.varlen`): a packed batch's documents become a few variable-length
kernel calls where the backend has them; every other backend gets them one at a time.  Each call's result
is merged as it returns, so a step holds one call's partial results, not every call's.  Layout: ``[b, s, h, d]``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from ..kernels import varlen
from ..kernels.base import BlockArgs, accumulator_dtype
from ..kernels.merge import merge_
from ..kernels.select import kernel_for
from .segments import BlockCall, whole


def new_accumulators(q: torch.Tensor, d_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty online-softmax state for ``q`` ``[b, s, h, d]``: out ``[b, s, h, d_v]`` = 0 and
    lse ``[b, h, s]`` = -inf, in the accumulator dtype."""
    b, s, h, _ = q.shape
    acc = accumulator_dtype(q)
    out = torch.zeros(b, s, h, d_v, dtype=acc, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)
    return out, lse


def attend_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    calls: tuple[BlockCall, ...],
    softmax_scale: float,
    backend: str | None,
    out_acc: torch.Tensor,
    lse_acc: torch.Tensor,
) -> None:
    """Run ``calls`` and merge each partial result into ``out_acc``/``lse_acc`` in place.

    q ``[b, s_q, h_q, d_qk]``, k ``[b, s_k, h_kv, d_qk]``, v ``[b, s_k, h_kv, d_v]`` (local,
    concatenated segments); out_acc ``[b, s_q, h_q, d_v]`` and lse_acc ``[b, h_q, s_q]`` in the
    accumulator dtype (float32, float64 for float64 inputs).  Each call's kernel comes from
    :func:`megatron_longctx.kernels.select.kernel_for` (``backend``: a name, or None for automatic).
    """
    for backend_module, items in _by_backend(q, k, v, calls, softmax_scale, backend):
        for i, (out, lse) in _forward_each(backend_module, q, k, v, items):  # merged as each call returns
            rows = slice(calls[i].q_lo, calls[i].q_hi)
            merge_(out_acc[:, rows], lse_acc[:, :, rows], out, lse)  # [b, rows, h_q, d_v], [b, h_q, rows]
            del out, lse


def _forward_each(backend_module, q, k, v, items):
    """``(call index, (out, lse))`` of each call as it returns: a backend with a many-block entry point
    (:func:`megatron_longctx.kernels.varlen.forward_blocks`: one variable-length call per kind) gets the
    step's calls at once, any other backend one call at a time, so only one call's result waits for
    its merge."""
    if getattr(backend_module, "forward_blocks", None) is not None:
        indices, blocks = zip(*items)
        results = varlen.forward_blocks(backend_module, q, k, v, blocks)
        for n, i in enumerate(indices):
            yield i, results[n]
            results[n] = None  # merged: drop it before the next
        return
    for i, b in items:
        yield i, varlen.forward_blocks(backend_module, q, k, v, [b])[0]


def _backward_each(backend_module, dout, q, k, v, out, lse, items):
    """``(call index, (dq, dk, dv))`` of each call as it returns (see :func:`_forward_each`)."""
    if getattr(backend_module, "backward_blocks", None) is not None:
        indices, blocks = zip(*items)
        grads = varlen.backward_blocks(backend_module, dout, q, k, v, out, lse, blocks)
        for n, i in enumerate(indices):
            yield i, grads[n]
            grads[n] = None
        return
    for i, b in items:
        yield i, varlen.backward_blocks(backend_module, dout, q, k, v, out, lse, [b])[0]


def _by_backend(q, k, v, calls: tuple[BlockCall, ...], softmax_scale: float, backend: str | None) -> list:
    """``[(backend module, [(call index, varlen.Block), ...]), ...]``: each call with the kernel that serves it
    (:func:`~megatron_longctx.kernels.select.kernel_for`), so a backend gets all of its calls at once."""
    groups: dict[int, tuple] = {}
    for i, c in enumerate(calls):
        args = _block_args(c, softmax_scale)
        module = kernel_for(q[:, c.q_lo:c.q_hi], k[:, c.k_lo:c.k_hi], v[:, c.k_lo:c.k_hi], args, backend)
        groups.setdefault(id(module), (module, []))[1].append((i, varlen.Block(c.q_lo, c.q_hi, c.k_lo, c.k_hi, args)))
    return list(groups.values())


class GradSum:
    """Sums of gradient contributions to tensors that share their token dim 1 (``[b, n, h, d]`` each).

    The first contribution to a token range is copied in and later ones are added, so no buffer is
    zero-filled first; :meth:`result` zeroes only the tokens no contribution reached (rows that see
    no key, keys no row sees).  ``flat``: the tensors are views of one contiguous buffer
    ``[sum numel]`` (a message for :class:`.comm.RingComm`), else each is its own tensor and a
    first contribution that covers every token in the right dtype is taken as it is (no copy).
    """

    def __init__(self, shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device, flat: bool = False):
        self.shapes, self.dtype, self.device, self.flat = list(shapes), dtype, device, flat
        self.n = self.shapes[0][1]
        self.buffer: torch.Tensor | None = None  # the flat message
        self.tensors: list[torch.Tensor] | None = None
        self._done: list[tuple[int, int]] = []  # sorted, disjoint token ranges written so far

    def _allocate(self) -> None:
        if self.flat:
            self.buffer = torch.empty(sum(math.prod(s) for s in self.shapes), dtype=self.dtype, device=self.device)
            self.tensors, offset = [], 0
            for shape in self.shapes:
                self.tensors.append(self.buffer[offset:offset + math.prod(shape)].view(shape))
                offset += math.prod(shape)
        else:
            self.tensors = [torch.empty(shape, dtype=self.dtype, device=self.device) for shape in self.shapes]

    def _parts(self, lo: int, hi: int):
        """``(start, stop, fresh)`` pieces of ``[lo, hi)``: fresh where nothing was written yet."""
        pos = lo
        for a, b in self._done:
            if b <= pos or a >= hi:
                continue
            if a > pos:
                yield pos, a, True
            yield max(a, pos), min(b, hi), False
            pos = min(b, hi)
        if pos < hi:
            yield pos, hi, True

    def add(self, lo: int, hi: int, grads: Sequence[torch.Tensor]) -> None:
        """Add ``grads`` (``[b, hi - lo, ...]`` each, any float dtype) to tokens ``[lo, hi)``."""
        if lo >= hi:
            return
        if self.tensors is None:
            if not self.flat and (lo, hi) == (0, self.n) and all(
                    g.dtype == self.dtype and g.is_contiguous() for g in grads):
                self.tensors, self._done = list(grads), [(0, self.n)]
                return
            self._allocate()
        for a, b, fresh in list(self._parts(lo, hi)):
            for t, g in zip(self.tensors, grads):
                dst, src = t[:, a:b], g[:, a - lo:b - lo]
                dst.copy_(src) if fresh else dst.add_(src)
        spans = sorted(self._done + [(lo, hi)])
        self._done = []
        for a, b in spans:
            if self._done and a <= self._done[-1][1]:
                self._done[-1] = (self._done[-1][0], max(b, self._done[-1][1]))
            else:
                self._done.append((a, b))

    def result(self) -> list[torch.Tensor]:
        """The sums, zero on tokens no contribution reached."""
        if self.tensors is None:
            self._allocate()
        for a, b, fresh in list(self._parts(0, self.n)):
            if fresh:
                for t in self.tensors:
                    t[:, a:b].zero_()
        self._done = [(0, self.n)]
        return self.tensors

    def message(self) -> torch.Tensor:
        """The flat buffer ``[sum numel]`` of a ``flat`` sum (see :meth:`result`)."""
        self.result()
        return self.buffer


class Rows(NamedTuple):
    """The query side of a backward: ``q`` ``[b, s_q, h_q, d_qk]``, the *final* ``out`` ``[b, s_q, h_q, d_v]``
    and ``lse`` ``[b, h_q, s_q]`` of every row (over all keys, not one block's), and ``dout`` (like ``out``).
    The rows stay while the keys they are taken against change (ring steps, tiles, gathered K/V)."""

    q: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    dout: torch.Tensor


def attend_segments_backward(
    rows: Rows,
    k: torch.Tensor,
    v: torch.Tensor,
    calls: tuple[BlockCall, ...],
    softmax_scale: float,
    backend: str | None,
    dq: GradSum,
    dkv: GradSum,
) -> None:
    """Backward of :func:`attend_segments` for ``rows`` against ``k``/``v`` ``[b, s_k, h_kv, d]``.

    Adds each call's gradients to ``dq`` (over ``[b, s_q, h_q, d_qk]``) and ``dkv`` (over dk
    ``[b, s_k, h_kv, d_qk]`` and dv ``[b, s_k, h_kv, d_v]``).
    """
    q, out, lse, dout = rows
    for backend_module, items in _by_backend(q, k, v, calls, softmax_scale, backend):
        for i, (dq_c, dk_c, dv_c) in _backward_each(backend_module, dout, q, k, v, out, lse, items):
            c = calls[i]  # added as each call returns
            dq.add(c.q_lo, c.q_hi, [dq_c])
            dkv.add(c.k_lo, c.k_hi, [dk_c, dv_c])
            del dq_c, dk_c, dv_c


def _block_args(c: BlockCall, softmax_scale: float) -> BlockArgs:
    return BlockArgs(softmax_scale=softmax_scale, mask=c.mask, q_start=c.q_start, k_start=c.k_start)


def attend_whole(q, k, v, call: BlockCall, softmax_scale: float, backend: str | None):
    """The kernel's (out in q's dtype, lse) for one call spanning q and k/v entirely."""
    args = _block_args(call, softmax_scale)
    return kernel_for(q, k, v, args, backend).forward(q, k, v, args)


def attend_whole_backward(rows: Rows, k, v, call: BlockCall, softmax_scale: float, backend: str | None):
    """The kernel's (dq, dk, dv), in the input dtypes, for one call spanning the rows and k/v entirely."""
    args = _block_args(call, softmax_scale)
    q, out, lse, dout = rows
    return kernel_for(q, k, v, args, backend).backward(dout, q, k, v, out, lse.contiguous(), args)


def attend_first(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: tuple[BlockCall, ...], softmax_scale: float,
    backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh accumulators holding the result of ``calls``: out ``[b, s_q, h_q, d_v]``, lse ``[b, h_q, s_q]``.

    A single call covering every row and key is the accumulator itself (merging one partial into
    zeros and ``-inf`` is the identity): no zero-filled buffers, no merge.
    """
    acc = accumulator_dtype(q)
    if whole(calls, q.shape[1], k.shape[1]):
        out, lse = attend_whole(q, k, v, calls[0], softmax_scale, backend)
        return out.to(acc), lse.to(acc)
    out, lse = new_accumulators(q, v.shape[-1])
    attend_segments(q, k, v, calls, softmax_scale, backend, out, lse)
    return out, lse


def attend_local(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, calls: tuple[BlockCall, ...], softmax_scale: float,
    backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local attention of q ``[b, s_q, h_q, d_qk]`` over k/v ``[b, s_k, h_kv, d]`` by ``calls`` -> out
    ``[b, s_q, h_q, d_v]`` (q's dtype), lse ``[b, h_q, s_q]`` (accumulator dtype).

    A single call covering the whole block returns the kernel's own result: no float32 accumulator
    and no merge.
    """
    if whole(calls, q.shape[1], k.shape[1]):
        out, lse = attend_whole(q, k, v, calls[0], softmax_scale, backend)
        return out.contiguous(), lse.to(accumulator_dtype(q))
    out, lse = attend_first(q, k, v, calls, softmax_scale, backend)
    return out.to(q.dtype), lse


def attend_local_backward(
    rows: Rows, k: torch.Tensor, v: torch.Tensor, calls: tuple[BlockCall, ...], softmax_scale: float,
    backend: str | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`attend_local` in the input dtypes (one whole call: the kernel's, held once)."""
    q, lse = rows.q, rows.lse
    if whole(calls, q.shape[1], k.shape[1]):
        return attend_whole_backward(rows, k, v, calls[0], softmax_scale, backend)
    acc = lse.dtype
    dq = GradSum([q.shape], acc, q.device)  # [b, s_q, h_q, d_qk]
    dkv = GradSum([k.shape, v.shape], acc, q.device)  # [b, s_k, h_kv, d_qk], [b, s_k, h_kv, d_v]
    attend_segments_backward(rows, k, v, calls, softmax_scale, backend, dq, dkv)
    (dq,), (dk, dv) = dq.result(), dkv.result()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
