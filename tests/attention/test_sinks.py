"""Attention sinks (``softmax_offset``) under every CP algorithm against a float64 oracle that appends the
sink as one more column of the scores (Megatron's ``SoftmaxOne``), on 2 and 4 gloo ranks.

Each rank builds the same global q/k/v and sinks, runs its shard (dense: ``shard_sequence``; THD:
``shard_packed``) forward and backward, gathers out, dq, dk, dv and sums the sink's gradient over the
ranks (what Megatron's data-parallel reduction over ``dp_cp`` does), and compares all five with the
oracle.  Both softmax types: ``off-by-one`` (zeros) and ``learnable`` (a random parameter).  The sink's
(out, lse) arithmetic is checked on its own against the appended logit, lse included.

Tolerances: float64 1e-10 (only the order of the sums differs); float32 1e-5 (out, grads).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_longctx.attention import (
    Packing,
    cp_attention,
    shard_packed,
    shard_sequence,
    unshard_packed,
    unshard_sequence,
)
from megatron_longctx.attention.sinks import add_sink, sink_grad
from tests.dist import run_ranks
from tests.oracle import attention, document_attention, sequence_attention, visible

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


@dataclasses.dataclass(frozen=True)
class Case:
    algorithm: str
    softmax_type: str = "learnable"
    packed: bool = False
    window: tuple[int, int] | None = None
    hq: int = 4
    hkv: int = 2
    ulysses_size: int | None = None
    dtype: torch.dtype = torch.float64
    chunk: int = 3  # dense: tokens per zigzag chunk
    lengths: tuple[int, ...] = (5, 12, 1)  # packed: document lengths
    backend: str | None = None


def _sink(case: Case, gen: torch.Generator) -> torch.Tensor:
    if case.softmax_type == "off-by-one":
        return torch.zeros(case.hq, dtype=torch.float64)
    return torch.randn(case.hq, generator=gen, dtype=torch.float64)


def _check(case: Case, seed: int) -> None:
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    packing = Packing.from_lengths(case.lengths, cp) if case.packed else None
    tokens = (packing.padded_total,) if case.packed else (2 * cp * case.chunk, 2)  # [t] or [s, b]
    d = 8

    def rand(heads):
        return torch.randn(*tokens, heads, d, generator=gen, dtype=torch.float64).to(case.dtype).double()

    q, k, v, dout = rand(case.hq), rand(case.hkv), rand(case.hkv), rand(case.hq)
    sink = _sink(case, gen)
    scale = d ** -0.5
    ref_in = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    if case.packed:
        ref_out = document_attention(*ref_in[:3], packing, True, case.window, scale, sink=ref_in[3])
    else:
        ref_out = sequence_attention(*ref_in[:3], True, case.window, scale, sink=ref_in[3])
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout)

    def shard(x):
        x = x.to(case.dtype)
        return shard_packed(x, packing, rank, cp) if case.packed else shard_sequence(x, rank, cp, seq_dim=0)

    local = [shard(x).requires_grad_() for x in (q, k, v)]
    offset = sink.to(case.dtype).requires_grad_(case.softmax_type == "learnable")
    out = cp_attention(*local, group, algorithm=case.algorithm, window_size=case.window, backend=case.backend,
                       ulysses_size=case.ulysses_size, packing=packing, softmax_offset=offset)
    out.backward(shard(dout))

    def gather(x):
        return unshard_packed(x, packing, group) if case.packed else unshard_sequence(x, group, 0)

    tol = TOL[case.dtype]
    for name, local_x, ref in zip(("out", "dq", "dk", "dv"), [out.detach()] + [x.grad for x in local],
                                  (ref_out.detach(), *ref_grads[:3])):
        assert_close(gather(local_x.contiguous()).double(), ref, atol=tol, rtol=tol,
                     msg=lambda m, n=name: f"{n}, {case} on rank {rank}\n{m}")
    if case.softmax_type == "learnable":
        dsink = offset.grad.double()
        dist.all_reduce(dsink, group=group)  # each rank holds its rows' (Ulysses: its heads') share
        assert_close(dsink, ref_grads[3], atol=tol, rtol=tol, msg=lambda m: f"dsink, {case} on rank {rank}\n{m}")
    else:
        assert offset.grad is None


def _cases(cp: int) -> list[Case]:
    algorithms = [("ring", None), ("allgather", None), ("ulysses", None), ("hybrid", 2 if cp == 4 else 1)]
    cases = []
    for i, ((algorithm, u), packed, window) in enumerate(
            itertools.product(algorithms, (False, True), (None, (4, 0)))):
        softmax_type = ("learnable", "off-by-one")[i % 2] if i % 4 else "learnable"
        hkv = (2, 1, 4)[i % 3]  # GQA, MQA, MHA
        cases.append(Case(algorithm, softmax_type, packed, window, 4, hkv, u))
    cases += [Case("ring", dtype=torch.float32, window=(3, 0)), Case("ulysses", dtype=torch.float32, packed=True),
              Case("ring", backend="reference", packed=True, window=(2, 0))]
    return cases


def _run(cases: list[Case]) -> int:
    for i, case in enumerate(cases):
        _check(case, seed=i)
    return len(cases)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sinks_match_float64_reference(world_size):
    cases = _cases(world_size)
    assert run_ranks(world_size, _run, cases) == [len(cases)] * world_size


def test_sink_on_one_rank_without_process_group():
    """cp_group None: the kernels' local attention with the sink, off-by-one and learnable."""
    assert not dist.is_initialized()
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(10, 1, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
    sink = torch.randn(4, generator=gen, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    out = cp_attention(*leaves[:3], None, algorithm="ring", window_size=(3, 0), softmax_offset=leaves[3])
    out.backward(dout)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    ref_out = sequence_attention(*ref_in[:3], True, (3, 0), 8 ** -0.5, sink=ref_in[3])
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout)
    assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    for leaf, ref in zip(leaves, ref_grads):
        assert_close(leaf.grad, ref, atol=1e-10, rtol=1e-10)


def test_add_sink_equals_an_appended_logit_lse_included():
    """(out, lse) of the keys, then the sink, equals the softmax over the keys plus one column; a row that
    sees no key keeps out 0 and gets lse = sink; dσ matches autograd of the appended column."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 6, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    sink = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(6)
    seen = visible(pos, pos, True, None) & (pos[:, None] > 0)  # row 0 sees nothing
    out, lse = attention(q, k, v, 0.5, seen)
    got_out, got_lse = add_sink(out, lse, sink)
    ref_out, ref_lse = attention(q, k, v, 0.5, seen, sink=sink)
    assert_close(got_out, ref_out, atol=1e-12, rtol=1e-12)
    assert_close(got_lse, ref_lse, atol=1e-12, rtol=1e-12)
    assert torch.equal(got_out[:, 0], torch.zeros_like(got_out[:, 0]))
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (ref_dsink,) = torch.autograd.grad(ref_out, sink, dout)
    assert_close(sink_grad(dout, got_out, got_lse, sink), ref_dsink, atol=1e-12, rtol=1e-12)


def _bad_offset() -> bool:
    q = torch.randn(4, 1, 4, 8)
    for offset, match in ((torch.zeros(3), r"\[4\] tensor"), (torch.zeros(4, dtype=torch.int64), "floating")):
        with pytest.raises(ValueError, match=match):
            cp_attention(q, q, q, None, algorithm="ring", softmax_offset=offset)
    return True


def test_bad_softmax_offset_is_named():
    assert _bad_offset()
