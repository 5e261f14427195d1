"""Every unsupported input to cp_attention / the sharding helpers is a ValueError naming the parameter."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_longctx.attention import cp_attention, schedule_flops, shard_sequence
from megatron_longctx.kernels.base import KernelUnsupported
from tests.dist import run_ranks


def _qkv(s=4, b=1, hq=4, hkv=2, d_qk=8, d_v=8, dtype=torch.float32):
    """q [s, b, hq, d_qk], k [s, b, hkv, d_qk], v [s, b, hkv, d_v]."""
    shapes = [(s, b, hq, d_qk), (s, b, hkv, d_qk), (s, b, hkv, d_v)]
    return tuple(torch.randn(*shape, dtype=dtype) for shape in shapes)


LOCAL_ERRORS = [  # (keyword arguments changed from a valid call, tensors, expected message fragment)
    ({"algorithm": "zigzag"}, _qkv(), "algorithm='zigzag'"),
    ({}, _qkv(hq=3, hkv=2), r"q heads \(3\) must be a multiple of k/v heads \(2\)"),
    ({}, (_qkv()[0], _qkv()[1], _qkv(hkv=1)[2]), "k and v must have the same number of heads"),
    ({}, (_qkv()[0], _qkv(d_qk=6)[1], _qkv()[2]), "head dim d_qk"),
    ({}, (_qkv()[0], _qkv(s=6)[1], _qkv(s=6)[2]), r"agree on \[s, b\]"),
    ({}, (_qkv()[0], *_qkv(dtype=torch.float64)[1:]), "dtype"),
    ({}, (_qkv()[0][0], *_qkv()[1:]), r"must be \[s, b, h, d\]"),
    ({"window_size": (-2, 0)}, _qkv(), "window_size"),
    ({"window_size": (1, 2, 3)}, _qkv(), "window_size"),
    ({"window_size": (1.5, 0)}, _qkv(), "window_size"),
    ({}, tuple(t.to(torch.int32) for t in _qkv()), "floating dtype"),
    ({"backend": "no_such_kernel"}, _qkv(), "backend='no_such_kernel'"),
    ({"ulysses_size": 2}, _qkv(), "ulysses_size"),
]


@pytest.mark.parametrize("kwargs,tensors,match", LOCAL_ERRORS)
def test_bad_inputs_without_group(kwargs, tensors, match):
    call = {"algorithm": "ring", **kwargs}
    with pytest.raises(ValueError, match=match):
        cp_attention(*tensors, None, **call)


def test_unavailable_backend_is_kernel_unsupported():
    with pytest.raises(KernelUnsupported, match="flash_attn"):
        cp_attention(*_qkv(), None, algorithm="ring", backend="flash_attn")


def test_schedule_flops_errors():
    with pytest.raises(ValueError, match="seq_len=100 must be divisible by 2\\*cp_size=8"):
        schedule_flops("ring", 4, 100)
    with pytest.raises(ValueError, match="algorithm='stripe'"):
        schedule_flops("stripe", 2, 8)


def test_shard_sequence_errors():
    x = torch.zeros(6, 2)
    with pytest.raises(ValueError, match=r"x.shape\[seq_dim\]=6 must be divisible by 2\*cp_size=4"):
        shard_sequence(x, 0, 2, seq_dim=0)
    with pytest.raises(ValueError, match="cp_rank=2"):
        shard_sequence(torch.zeros(8, 2), 2, 2, seq_dim=0)


DISTRIBUTED_ERRORS = [  # (keyword arguments, _qkv arguments, expected message fragment) on 2 ranks
    ({"algorithm": "ring"}, {"s": 3}, r"q.shape\[0\]=3.*divisible by 2\*cp=4"),
    ({"algorithm": "ulysses"}, {"hq": 3, "hkv": 1}, r"query heads \(3\).*algorithm='ring'.*'hybrid'"),
    ({"algorithm": "hybrid", "ulysses_size": 3}, {}, "ulysses_size=3 must be a positive divisor"),
    ({"algorithm": "hybrid"}, {}, "needs ulysses_size="),
    ({"algorithm": "hybrid", "ulysses_size": 2}, {"hq": 3, "hkv": 1}, r"ulysses_size=2 must divide the query heads \(3\)"),
    ({"algorithm": "ulysses", "ulysses_size": 1}, {}, "use algorithm='hybrid'"),
    ({"algorithm": "allgather", "hcp_groups": 2}, {}, "hcp_groups"),  # hcp_groups: that many WORLD groups
    ({"algorithm": "hybrid", "hcp_groups": 1}, {}, r"hcp_groups must be \(a2a_group, ring_group\)"),
    # Local lengths that differ between ranks (each is even, so only the cross-rank check sees it).
    ({"algorithm": "ring"}, {"s": "4 + 2 * rank"}, "differ across the ranks of cp_group"),
]


def _distributed_error(kwargs, shape, match):
    world, rank = dist.group.WORLD, dist.get_rank()
    if "hcp_groups" in kwargs:
        kwargs = {**kwargs, "hcp_groups": (world,) * kwargs["hcp_groups"]}
    if shape.get("s") == "4 + 2 * rank":
        shape = {**shape, "s": 4 + 2 * rank}
    with pytest.raises(ValueError, match=match):
        cp_attention(*_qkv(**shape), world, **kwargs)
    return True


@pytest.mark.parametrize("kwargs,shape,match", DISTRIBUTED_ERRORS)
def test_bad_inputs_with_group(kwargs, shape, match):
    assert run_ranks(2, _distributed_error, kwargs, shape, match) == [True, True]
