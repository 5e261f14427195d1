"""cp_attention_packed (THD) against per-document float64 attention, on 2 and 4 gloo ranks.

Each rank builds the same padded packed q/k/v, takes its per-document zigzag shard with
``shard_packed``, runs forward and backward, gathers output and gradients with ``unshard_packed`` and
compares them with plain autograd attention computed document by document on the unsharded sequence
(padding rows: out 0, grads 0).  Every algorithm, causal / non-causal / sliding windows, GQA/MQA,
documents of length 1, lengths not divisible by 2*cp and one document spanning every rank.  Each
case is its own test (the ranks are spawned once per world size and reused).

Tolerances (atol out, atol grads, rtol): float64 1e-10 (only the order of the sums differs), float32
1e-5, bfloat16 2e-2 / 5e-2 / 2e-2 (inputs rounded to bfloat16 for the oracle too; each block returns
bfloat16 before the merge).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_longctx.attention import cp_attention
from megatron_longctx.attention.packed import (
    Packing,
    cp_attention_packed,
    real_token_mask,
    shard_packed,
    unshard_packed,
)
from tests.dist import run_ranks
from tests.oracle import document_attention

TOL = {torch.float64: (1e-10, 1e-10, 1e-10), torch.float32: (1e-5, 1e-5, 1e-5), torch.bfloat16: (2e-2, 5e-2, 2e-2)}


@dataclasses.dataclass(frozen=True)
class Case:
    algorithm: str
    lengths: tuple[int, ...]
    causal: bool = True
    window: tuple[int, int] | None = None
    hq: int = 4
    hkv: int = 2
    d_qk: int = 8
    d_v: int = 8
    dtype: torch.dtype = torch.float64
    ulysses_size: int | None = None


def _check_case(case: Case, seed: int, group=None, hcp_groups=None) -> None:
    group = group or dist.group.WORLD
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    packing = Packing.from_lengths(case.lengths, cp)
    gen = torch.Generator().manual_seed(seed)
    t = packing.padded_total

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rand(t, case.hq, case.d_qk), rand(t, case.hkv, case.d_qk), rand(t, case.hkv, case.d_v)
    dout = rand(t, case.hq, case.d_v)
    q, k, v, dout = (x.to(case.dtype).double() for x in (q, k, v, dout))  # the oracle sees the rounded inputs
    scale = case.d_qk ** -0.5
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out = document_attention(*ref_in, packing, case.causal, case.window, scale)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout)

    local = [shard_packed(x.to(case.dtype), packing, rank, cp).requires_grad_() for x in (q, k, v)]
    extra = {"hcp_groups": hcp_groups} if hcp_groups is not None else {"ulysses_size": case.ulysses_size}
    if seed % 2:  # the packed path through the common entry point
        out = cp_attention(*local, group, algorithm=case.algorithm, causal=case.causal, window_size=case.window,
                           packing=packing, **extra)
    else:
        out = cp_attention_packed(*local, group, packing, algorithm=case.algorithm, causal=case.causal,
                                  window_size=case.window, **extra)
    out.backward(shard_packed(dout.to(case.dtype), packing, rank, cp))

    assert out.dtype == case.dtype and out.shape == (t // cp, case.hq, case.d_v)
    atol_out, atol_grad, rtol = TOL[case.dtype]
    msg = f"{case} on rank {rank}"
    got_out = unshard_packed(out.detach(), packing, group).double()
    assert_close(got_out, ref_out.detach(), atol=atol_out, rtol=rtol, msg=lambda m: f"out, {msg}\n{m}")
    pad = ~real_token_mask(packing)
    assert torch.count_nonzero(got_out[pad]) == 0, f"padding rows got output, {msg}"
    for name, x, ref in zip("qkv", local, ref_grads):
        assert x.grad.dtype == case.dtype
        got = unshard_packed(x.grad, packing, group).double()
        assert_close(got, ref, atol=atol_grad, rtol=rtol, msg=lambda m, n=name: f"d{n}, {msg}\n{m}")
        assert torch.count_nonzero(got[pad]) == 0, f"padding tokens got a d{name}, {msg}"


MASKS = [(True, None), (False, None), (True, (3, 0)), (False, (2, 1)), (True, (0, 0))]
SHAPES = [(4, 2, 8, 8), (4, 1, 8, 6), (4, 4, 6, 8)]  # (hq, hkv, d_qk, d_v): GQA, MQA + MLA dims, MHA


def _packings(cp: int) -> list[tuple[int, ...]]:
    """Lengths of length 1, not divisible by 2*cp, one spanning every rank, a single document."""
    unit = 2 * cp
    return [(1, 3 * unit + 3, 2, unit), (5 * unit - 1,), (unit + 1, 1, 1, unit - 1)]


def _cases(cp: int) -> list[Case]:
    algorithms = [("ring", None), ("allgather", None), ("ulysses", None), ("hybrid", 1), ("hybrid", cp)]
    if cp == 4:
        algorithms.append(("hybrid", 2))
    packings = itertools.cycle(_packings(cp))
    shapes = itertools.cycle(SHAPES)
    cases = []
    for (algorithm, u), (causal, window) in itertools.product(algorithms, MASKS):
        hq, hkv, d_qk, d_v = next(shapes)
        cases.append(Case(algorithm, next(packings), causal, window, hq, hkv, d_qk, d_v, ulysses_size=u))
    for algorithm, u in algorithms:
        cases.append(Case(algorithm, _packings(cp)[0], dtype=torch.float32, ulysses_size=u))
    for algorithm in ("ring", "allgather", "ulysses"):
        cases.append(Case(algorithm, _packings(cp)[2], window=(4, 0), dtype=torch.bfloat16))
    return cases


def _explicit_groups_and_errors() -> bool:
    """Hybrid over Megatron-style hierarchical groups; distributed input errors on every rank."""
    rank = dist.get_rank()
    a2a_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ring_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = (a2a_groups[rank // 2], ring_groups[rank % 2])
    _check_case(Case("hybrid", (3, 17, 1), hq=4, hkv=1), seed=200, hcp_groups=groups)
    packing = Packing.from_lengths((9, 4), 4)
    q = torch.zeros(packing.padded_total // 4, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"q.shape\[0\]=5 local tokens"):
        cp_attention_packed(q[:5], q[:5], q[:5], dist.group.WORLD, packing, algorithm="ring")
    with pytest.raises(ValueError, match="multiple of 2\\*cp=8"):
        cp_attention_packed(q, q, q, dist.group.WORLD, Packing.from_lengths((9, 4), 2), algorithm="ring")
    with pytest.raises(ValueError, match="query heads"):
        cp_attention_packed(q[:, :2], q[:, :2], q[:, :2], dist.group.WORLD, packing, algorithm="ulysses")
    other = Packing.from_lengths((9, 4) if rank else (10, 3), 4)  # same padded total, other documents on rank 0
    with pytest.raises(ValueError, match="disagree on the packing"):
        cp_attention_packed(q, q, q, dist.group.WORLD, other, algorithm="allgather")
    return True


def case_id(case: Case) -> str:
    algorithm = case.algorithm + (f"{case.ulysses_size}" if case.ulysses_size else "")
    mask = ("causal" if case.causal else "full") + (f"-w{case.window[0]}.{case.window[1]}" if case.window else "")
    docs = ".".join(map(str, case.lengths))
    return f"{algorithm}-{str(case.dtype).removeprefix('torch.')}-{mask}-h{case.hq}.{case.hkv}-docs{docs}"


# One test per (world size, case): a failing case does not hide the others.
@pytest.mark.parametrize("world_size,seed,case", [(w, i, c) for w in (2, 4) for i, c in enumerate(_cases(w))],
                         ids=[f"cp{w}-{i}-{case_id(c)}" for w in (2, 4) for i, c in enumerate(_cases(w))])
def test_packed_matches_per_document_reference(world_size, seed, case):
    run_ranks(world_size, _check_case, case, seed)


def test_packed_hybrid_with_explicit_groups_and_errors():
    assert run_ranks(4, _explicit_groups_and_errors) == [True] * 4
