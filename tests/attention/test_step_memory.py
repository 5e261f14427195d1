"""Bytes one step of the block loop holds: its calls' partial results are merged as each call returns, so
the step holds one call's (out, lse) and one call's (dq, dk, dv) at a time, however many calls it makes.

A step with many calls (keys cut into blocks, as the tiled replay cuts the gathered keys; each call's
out and dq as long as all the rows) is counted with
:class:`~megatron_longctx.bench.live_memory.LiveTensors` (live tensors, not RSS) and bounded by the
accumulators plus a few calls' worth; a loop that kept every call's results before merging holds
``calls`` times that and fails."""

from __future__ import annotations

import pytest
import torch

from megatron_longctx.attention.block_loop import Rows, attend_local, attend_local_backward
from megatron_longctx.kernels.base import BlockMask
from megatron_longctx.attention.segments import Segment, schedule_blocks, split_keys
from megatron_longctx.bench.live_memory import LiveTensors

S, HQ, HKV, D, KEY_BLOCK = 2048, 4, 2, 16, 128  # 16 key blocks: 16 calls, each over all 2048 rows


def _step_peak(calls) -> tuple[int, int]:
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, S, HQ, D, generator=gen) for _ in range(2))  # [b, s, h, d]
    k, v = (torch.randn(1, S, HKV, D, generator=gen) for _ in range(2))
    with LiveTensors() as forward:
        out, lse = attend_local(q, k, v, calls, D ** -0.5, "cpu_flash")
    with LiveTensors() as backward:
        grads = attend_local_backward(Rows(q, out, lse, dout), k, v, calls, D ** -0.5, "cpu_flash")
    del grads
    return forward.peak, backward.peak


@pytest.mark.parametrize("mask", [BlockMask(causal=False), BlockMask(causal=True)])
def test_a_step_of_many_calls_holds_one_calls_results_at_a_time(mask):
    calls = split_keys(schedule_blocks((Segment(0, S),), (Segment(0, S),), mask), KEY_BLOCK)
    assert len(calls) == S // KEY_BLOCK
    forward, backward = _step_peak(calls)
    row = 4 * S * HQ * (D + 1)  # float32 out [1, S, HQ, D] and lse [1, HQ, S]: one call's forward result
    grads = 4 * (S * HQ * D + 2 * S * HKV * D)  # float32 dq, dk, dv over every row and key
    # measured 3.9 rows, 3.6 grads (collected first: 11-19 rows, 6.8-10.5 grads)
    # forward: the accumulators (one row's worth), the result in q's dtype, one call's result and its
    # kernel's temporaries; 16 calls collected first would hold 16 rows' worth
    assert forward <= 5 * row, (forward / row, len(calls))
    # backward: the sums (one grads' worth, plus their conversion to the input dtype) and one call's
    # dq [S rows] and dk/dv [KEY_BLOCK keys]; 16 calls collected first hold 16 dq
    assert backward <= 4.5 * grads, (backward / grads, len(calls))
    assert forward > row and backward > grads  # the count sees the step's own results
