"""Ranks that disagree fail fast and loudly: one check on the first call of a configuration, none after.

Each mismatch is injected for real on 2 gloo ranks (one rank passes something else); both ranks must
raise a ``ValueError`` naming the parameter and the ranks, within the harness timeout (no hang, no
abort inside gloo).  The cost test counts the collectives ``torch.distributed`` issues.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_longctx.attention import Packing, cp_attention, cp_attention_packed
from tests.dist import run_ranks

TIMEOUT_S = 60  # a mismatch must be an error within seconds, never a hang


def _qkv(dtype=torch.float32, s_local=8):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s_local, 1, 2, 4, generator=gen).to(dtype) for _ in range(3)]


def _dense_mismatch(param: str) -> str:
    rank = dist.get_rank()
    call = {"algorithm": "ring"}
    dtype = torch.float32
    if param == "algorithm":
        call["algorithm"] = "ring" if rank == 0 else "allgather"
    elif param == "window_size":
        call["window_size"] = (2, 0) if rank == 1 else None
    elif param == "causal":
        call["causal"] = rank == 0
    elif param == "dtype":
        dtype = torch.float32 if rank == 0 else torch.bfloat16
    with pytest.raises(ValueError) as err:
        cp_attention(*_qkv(dtype), dist.group.WORLD, **call)
    return str(err.value)


def _packed_mismatch() -> str:
    rank = dist.get_rank()
    packing = Packing.from_cu_seqlens((0, 4, 28, 32) if rank == 0 else (0, 16, 20, 32))
    q = torch.randn(16, 2, 4)
    with pytest.raises(ValueError) as err:
        cp_attention_packed(q, q, q, dist.group.WORLD, packing, algorithm="ring")
    return str(err.value)


@pytest.mark.parametrize("param", ["algorithm", "window_size", "causal", "dtype"])
def test_dense_mismatch_raises_on_every_rank(param):
    messages = run_ranks(2, _dense_mismatch, param, timeout=TIMEOUT_S)
    for message in messages:
        assert f"disagree on the {param}" in message
        assert "cp ranks [0] vs cp ranks [1]" in message


def test_packings_with_the_same_total_differ():
    """(0,4,28,32) and (0,16,20,32): same documents count and total, which a weighted checksum let pass."""
    messages = run_ranks(2, _packed_mismatch, timeout=TIMEOUT_S)
    for message in messages:
        assert "disagree on the packing (cu_seqlens, cu_seqlens_padded)" in message
        assert "cp ranks [0] vs cp ranks [1]" in message
    assert "(0, 4, 28, 32)" in messages[0] and "(0, 16, 20, 32)" in messages[1]


_COLLECTIVES = ("all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce", "broadcast",
                "all_to_all_single", "reduce_scatter_tensor")


def _collectives_per_call() -> list[int]:
    """Collectives issued by each of three ring calls of one configuration, then of a new one."""
    counts = {"n": 0}
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def counting(fn):
        def wrapped(*args, **kwargs):
            counts["n"] += 1
            return fn(*args, **kwargs)
        return wrapped

    for name, fn in originals.items():
        setattr(dist, name, counting(fn))
    try:
        per_call = []
        for window in (None, None, None, (3, 0)):
            counts["n"] = 0
            # A softmax_scale no other test uses: a configuration this reused rank has not seen yet.
            out = cp_attention(*_qkv(s_local=6), dist.group.WORLD, algorithm="ring", window_size=window,
                               softmax_scale=0.3125)
            assert torch.isfinite(out).all()
            per_call.append(counts["n"])
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return per_call


def test_check_runs_once_per_configuration():
    """The ring itself is point-to-point: the only collective is the check, on a configuration's first call."""
    assert run_ranks(2, _collectives_per_call, timeout=TIMEOUT_S) == [[1, 0, 0, 1]] * 2
