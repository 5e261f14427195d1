"""cp_attention against a float64 single-process oracle, on 2 and 4 gloo ranks.

Each rank builds the same global q/k/v, takes its zigzag shard (chunks ``r`` and ``2cp-1-r`` of ``2cp``,
cut here by the test from the rule, not by ``shard_sequence``: a layout bug in the package must not
cancel out), runs ``cp_attention`` forward and backward, all-gathers output and gradients, puts the
chunks back in natural order the same way and compares them with plain autograd attention over the
whole sequence in float64.  ``shard_sequence``/``unshard_sequence`` are checked against the rule
directly.  Each case is its own test (the ranks are spawned once per world size and reused).

Tolerances (atol = rtol unless said): float64 1e-10 (only the order of the sums differs); float32
1e-5 (measured <= 1e-6); bfloat16 (inputs rounded to bfloat16, oracle in float64 on the rounded
inputs) atol 2e-2 on the output and 5e-2 on the gradients, rtol 2e-2 (measured <= 7.5e-3 and
2.4e-2): each block returns its output and gradients in bfloat16 before they are merged.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_longctx.attention import cp_attention, shard_sequence, unshard_sequence
from tests.dist import run_ranks
from tests.oracle import sequence_attention

TOL = {torch.float64: (1e-10, 1e-10, 1e-10), torch.float32: (1e-5, 1e-5, 1e-5), torch.bfloat16: (2e-2, 5e-2, 2e-2)}


@dataclasses.dataclass(frozen=True)
class Case:
    algorithm: str
    dtype: torch.dtype = torch.float64
    causal: bool = True
    window: tuple[int, int] | None = None
    hq: int = 4
    hkv: int = 4
    d_qk: int = 8
    d_v: int = 8
    batch: int = 1
    chunk: int = 3
    ulysses_size: int | None = None
    backend: str | None = None  # block kernel; None = automatic (cpu_flash on CPU)


def _zigzag_shard(x: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """The rule, written here: ``[s, ...]`` -> ``[s/cp, ...]``, chunks ``rank`` and ``2cp-1-rank`` of ``2cp``."""
    c = x.shape[0] // (2 * cp)
    return torch.cat([x[rank * c:(rank + 1) * c], x[(2 * cp - 1 - rank) * c:(2 * cp - rank) * c]])


def _zigzag_unshard(x_local: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`_zigzag_shard` over ``group``: ``[s/cp, ...]`` on every rank -> ``[s, ...]``."""
    cp = dist.get_world_size(group)
    shards = [torch.empty_like(x_local) for _ in range(cp)]
    dist.all_gather(shards, x_local.contiguous(), group=group)  # cp x [s/cp, ...]
    chunks = [None] * (2 * cp)
    for r, shard in enumerate(shards):
        chunks[r], chunks[2 * cp - 1 - r] = shard.chunk(2)  # [s/(2cp), ...] each
    return torch.cat(chunks)  # [s, ...]


def _inputs(case: Case, cp: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    s = 2 * cp * case.chunk

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(case.dtype)

    q = rand(s, case.batch, case.hq, case.d_qk)
    k = rand(s, case.batch, case.hkv, case.d_qk)
    v = rand(s, case.batch, case.hkv, case.d_v)
    dout = rand(s, case.batch, case.hq, case.d_v)
    return q, k, v, dout


def _check_case(case: Case, seed: int, group=None, hcp_groups=None):
    group = group or dist.group.WORLD
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, dout = _inputs(case, cp, seed)
    scale = case.d_qk ** -0.5

    ref_in = [t.to(torch.float64, copy=True).requires_grad_() for t in (q, k, v)]
    ref_out = sequence_attention(*ref_in, case.causal, case.window, scale)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout.to(torch.float64))

    local = [_zigzag_shard(t, rank, cp).requires_grad_() for t in (q, k, v)]
    extra = {"hcp_groups": hcp_groups} if hcp_groups is not None else {"ulysses_size": case.ulysses_size}
    out = cp_attention(*local, group, algorithm=case.algorithm, causal=case.causal, window_size=case.window,
                       backend=case.backend, **extra)
    out.backward(_zigzag_shard(dout, rank, cp))

    assert out.dtype == case.dtype and out.shape == local[0].shape[:3] + (case.d_v,)
    assert all(t.grad.dtype == case.dtype for t in local)
    # One all-gather for out, dq, dk, dv: [s/cp, b, h, d] each -> [s/cp, b, sum(h*d)] -> [s, b, sum(h*d)]
    results = [out.detach()] + [t.grad for t in local]
    gathered = _zigzag_unshard(torch.cat([r.flatten(2) for r in results], dim=2), group).double()
    pieces = gathered.split([r[0, 0].numel() for r in results], dim=2)
    atol_out, atol_grad, rtol = TOL[case.dtype]
    for name, piece, result, ref in zip(["out", "dq", "dk", "dv"], pieces, results, (ref_out.detach(), *ref_grads)):
        got = piece.unflatten(2, result.shape[2:])  # [s, b, h, d]
        atol = atol_out if name == "out" else atol_grad
        assert_close(got, ref, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}, {case} on rank {rank}\n{m}")


# (causal, window): full, windows ending inside a neighbour's chunk (chunk 3, left 4), a zero-width
# window, one-sided non-causal windows, and a window wider than the sequence.
MASKS = [
    (True, None), (False, None), (True, (2, 0)), (True, (4, 0)), (False, (1, 2)), (False, (3, 0)),
    (True, (0, 0)), (False, (-1, 2)), (False, (5, -1)), (True, (100, -1)),
]
SHAPES = [  # (hq, hkv, d_qk, d_v, batch, chunk): MHA, GQA, MQA, MLA head dims, batch 2, chunks 1..3
    (4, 4, 8, 8, 1, 3), (4, 2, 8, 6, 2, 1), (4, 1, 8, 8, 1, 2), (8, 2, 6, 8, 2, 3), (4, 1, 4, 6, 1, 1),
]


def _cases(cp: int) -> list[Case]:
    # Hybrid's edge cases (a ring of one group, all-to-all groups of one rank) run at cp=2.
    algorithms = [("ring", None), ("allgather", None), ("ulysses", None)]
    algorithms += [("hybrid", 1), ("hybrid", 2)] if cp == 2 else [("hybrid", 2)]
    cases = []
    for (a, (algorithm, u)), (m, (causal, window)) in itertools.product(enumerate(algorithms), enumerate(MASKS)):
        hq, hkv, d_qk, d_v, batch, chunk = SHAPES[(a + m) % len(SHAPES)]  # each algorithm pairs them differently
        cases.append(Case(algorithm, torch.float64, causal, window, hq, hkv, d_qk, d_v, batch, chunk, u))
    for (algorithm, u), dtype in itertools.product(algorithms, (torch.float32, torch.bfloat16)):
        cases.append(Case(algorithm, dtype, True, None, 4, 2, 8, 8, 1, 4, u))
        cases.append(Case(algorithm, dtype, False, (3, 2), 4, 1, 8, 6, 2, 3, u))
    return cases


def _run_cases(cases: list[Case]) -> int:
    for i, case in enumerate(cases):
        _check_case(case, seed=i)
    return len(cases)


def case_id(case: Case) -> str:
    """A readable test id: algorithm, dtype, mask, heads and dims."""
    algorithm = case.algorithm + (f"{case.ulysses_size}" if case.ulysses_size else "")
    mask = ("causal" if case.causal else "full") + (f"-w{case.window[0]}.{case.window[1]}" if case.window else "")
    return f"{algorithm}-{str(case.dtype).removeprefix('torch.')}-{mask}-h{case.hq}.{case.hkv}-d{case.d_qk}.{case.d_v}"


# One test per (world size, case): a failing case does not hide the others.
@pytest.mark.parametrize("world_size,seed,case", [(w, i, c) for w in (2, 4) for i, c in enumerate(_cases(w))],
                         ids=[f"cp{w}-{i}-{case_id(c)}" for w in (2, 4) for i, c in enumerate(_cases(w))])
def test_matches_float64_reference(world_size, seed, case):
    run_ranks(world_size, _check_case, case, seed)


def test_shard_sequence_takes_chunks_r_and_mirror():
    for cp in (1, 2, 3, 4):
        x = torch.arange(2 * cp * 3 * 2).view(2, 2 * cp * 3)  # [b, s]: token i holds i (+ s in row 1)
        s = x.shape[1]
        for r in range(cp):
            chunks = (r, 2 * cp - 1 - r)
            expected = torch.tensor([j * 3 + t for j in chunks for t in range(3)])  # token ids of the two chunks
            assert torch.equal(shard_sequence(x, r, cp, seq_dim=1), torch.stack([expected, expected + s])), (cp, r)


def _unshard_inverts_shard(cp_seq_dims):
    rank, cp = dist.get_rank(), dist.get_world_size()
    for seq_dim in cp_seq_dims:
        x = torch.arange(2 * cp * 5 * 3).view(*([2 * cp * 5, 3] if seq_dim == 0 else [3, 2 * cp * 5]))
        local = shard_sequence(x, rank, cp, seq_dim)
        assert torch.equal(unshard_sequence(local, dist.group.WORLD, seq_dim), x)
        if seq_dim == 0:
            assert torch.equal(local, _zigzag_shard(x, rank, cp))
    return True


def test_unshard_sequence_inverts_shard_sequence():
    # cp=4 only: the pool of the last cases above is reused (cp=2 is the same code with fewer chunks)
    assert run_ranks(4, _unshard_inverts_shard, (0, 1)) == [True] * 4


def _run_with_zero(module: str, limit: str, cases):
    """:func:`_run_cases` with ``megatron_longctx.attention.<module>.<limit>`` set to 0 (restored after)."""
    mod = importlib.import_module(f"megatron_longctx.attention.{module}")
    value = getattr(mod, limit)
    setattr(mod, limit, 0)
    try:
        return _run_cases(cases)
    finally:
        setattr(mod, limit, value)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_backward_without_the_overlap_split(world_size):
    # every shard "long": the local block whole, first; dK, dV as two messages
    cases = [c for c in _cases(world_size) if c.algorithm == "ring"]
    assert run_ranks(world_size, _run_with_zero, "ring", "OVERLAP_MAX_TOKENS", cases)[0] == len(cases) > 0


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_and_hybrid_with_one_all_to_all_per_tensor(world_size):
    # every shard "long": q, k, v and their gradients in their own all-to-alls
    cases = [c for c in _cases(world_size) if c.algorithm in ("ulysses", "hybrid")]
    assert run_ranks(world_size, _run_with_zero, "ulysses", "PACK_MAX_TOKENS", cases)[0] == len(cases) > 0


def _uneven_heads():
    """Heads that only some algorithms take (ring/all-gather with h_q % cp != 0, hybrid MQA), and the
    reference kernel asked for by name."""
    cases = [Case("ring", hq=3, hkv=1, chunk=2), Case("allgather", hq=6, hkv=3, window=(2, 0), chunk=3),
             Case("hybrid", hq=6, hkv=1, ulysses_size=2, chunk=1), Case("ulysses", hq=4, hkv=1, chunk=3, batch=2),
             Case("ring", window=(4, 0), backend="reference"), Case("hybrid", ulysses_size=2, backend="reference")]
    return _run_cases(cases)


def test_uneven_heads_and_named_backend_cp4():
    assert run_ranks(4, _uneven_heads) == [6] * 4


def _hybrid_with_megatron_groups():
    """Hybrid fed with explicit (a2a, ring) groups laid out as Megatron's hierarchical CP groups."""
    rank = dist.get_rank()
    a2a_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ring_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = (a2a_groups[rank // 2], ring_groups[rank % 2])
    for i, case in enumerate([Case("hybrid", hq=4, hkv=1), Case("hybrid", causal=False, window=(2, 3), chunk=2)]):
        _check_case(case, seed=100 + i, hcp_groups=groups)
    with pytest.raises(ValueError, match="hcp_groups"):
        cp_attention(*_inputs(Case("hybrid"), 4, 0)[:3], dist.group.WORLD, algorithm="hybrid",
                     hcp_groups=groups[::-1])
    return True


def test_hybrid_with_explicit_groups():
    assert run_ranks(4, _hybrid_with_megatron_groups) == [True] * 4


@pytest.mark.parametrize("case", [Case("ring"), Case("ulysses", causal=False, window=(2, 1), hq=4, hkv=1, d_v=6),
                                  Case("hybrid", dtype=torch.float32, window=(3, 0), batch=2)])
def test_without_process_group(case):
    """cp_group=None in a process without torch.distributed: plain local attention."""
    assert not dist.is_initialized()
    q, k, v, dout = _inputs(case, 1, seed=7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cp_attention(*leaves, None, algorithm=case.algorithm, causal=case.causal, window_size=case.window)
    out.backward(dout)
    ref_in = [t.to(torch.float64, copy=True).requires_grad_() for t in (q, k, v)]
    ref_out = sequence_attention(*ref_in, case.causal, case.window, case.d_qk ** -0.5)
    ref_grads = torch.autograd.grad(ref_out, ref_in, dout.to(torch.float64))
    atol_out, atol_grad, rtol = TOL[case.dtype]
    assert_close(out.double(), ref_out, atol=atol_out, rtol=rtol)
    for leaf, ref in zip(leaves, ref_grads):
        assert_close(leaf.grad.double(), ref, atol=atol_grad, rtol=rtol)
