"""Bytes a CP attention step holds: the storages created by forward + backward of one rank's attention
(:class:`~megatron_longctx.bench.live_memory.LiveTensors`), at two sequence lengths on 2 gloo ranks.

The growth per token of the rank's shard is bounded by a multiple of what the step must hold anyway (q,
k, v, out and their gradients: ``IO_BYTES`` per token); a path that turned quadratic (scores of a whole
block kept, a dense mask, a gathered copy per step) would grow with the length and fail.  Bounds are
1.25-1.5x the measured growth (the comments give the figures)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_longctx.attention import cp_attention, shard_sequence
from megatron_longctx.bench.live_memory import LiveTensors
from tests.dist import run_ranks

HQ, HKV, D = 4, 2, 16
IO_BYTES = 4 * (2 * HQ * D + 2 * 2 * HKV * D)  # float32 q, out, k, v and their gradients, per token
LENGTHS = (1024, 4096)


def _peak(algorithm: str, seq: int, window) -> int:
    cp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seq)
    q, dout = (torch.randn(seq, 1, HQ, D, generator=gen) for _ in range(2))  # Megatron's [s, b, h, d]
    k, v = (torch.randn(seq, 1, HKV, D, generator=gen) for _ in range(2))
    local = [shard_sequence(x, rank, cp, 0).requires_grad_() for x in (q, k, v)]
    dout = shard_sequence(dout, rank, cp, 0)
    with LiveTensors() as live:
        out = cp_attention(*local, dist.group.WORLD, algorithm=algorithm, causal=True, window_size=window,
                           backend="cpu_flash")
        out.backward(dout)
        del out
    return live.peak


def _growth(algorithm: str, window) -> float:
    low, high = (_peak(algorithm, s, window) for s in LENGTHS)
    return (high - low) / ((LENGTHS[1] - LENGTHS[0]) // dist.get_world_size())  # bytes per token of the shard


# bound in IO_BYTES per shard token; the comment gives the measured growth of the two ranks
@pytest.mark.parametrize("algorithm,window,bound", [
    ("ring", None, 3.0),  # 1.94, 2.26
    ("ring", (64, 0), 3.0),  # 2.40, 1.92
    ("ulysses", None, 2.5),  # 1.67, 1.67
    ("allgather", None, 4.5),  # 3.20, 2.83: the gathered K/V of both ranks
])
def test_a_cp_step_holds_bytes_linear_in_the_sequence(algorithm, window, bound):
    growth = run_ranks(2, _growth, algorithm, window)
    assert max(growth) <= bound * IO_BYTES, ([g / IO_BYTES for g in growth], bound)
    assert min(growth) > 0.5 * IO_BYTES  # the count sees the step (its outputs and gradients at least)
