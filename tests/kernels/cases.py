"""Block cases shared by the kernel tests, an independent float64 oracle, and input makers."""

from __future__ import annotations

import dataclasses

import torch

from megatron_longctx.kernels import BlockArgs, BlockMask

CAUSAL = BlockMask(causal=True)
DENSE = BlockMask(causal=False)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mask: BlockMask
    s_q: int = 8
    s_k: int = 8
    q_start: int = 0
    k_start: int = 0
    b: int = 1
    h_q: int = 2
    h_kv: int = 2
    d_qk: int = 8
    d_v: int = 8

    def args(self, scale: float = 0.37) -> BlockArgs:
        return BlockArgs(softmax_scale=scale, mask=self.mask, q_start=self.q_start, k_start=self.k_start)


CASES = [
    Case("dense", DENSE, b=2),
    Case("dense_sq_lt_sk", DENSE, s_q=5, s_k=11),
    Case("dense_sq_gt_sk", DENSE, s_q=11, s_k=4),
    Case("causal_diagonal", CAUSAL, q_start=16, k_start=16, b=2),
    Case("causal_q_after_k", CAUSAL, q_start=24, k_start=16),  # every pair visible
    Case("causal_q_overlaps_after", CAUSAL, q_start=20, k_start=16),
    Case("causal_q_overlaps_before", CAUSAL, q_start=12, k_start=16),  # first rows see nothing
    Case("causal_q_before_k", CAUSAL, q_start=0, k_start=16),  # no row sees anything
    Case("causal_allgather_tail", CAUSAL, s_q=4, s_k=16, q_start=12, k_start=0),
    Case("causal_sq_gt_sk", CAUSAL, s_q=12, s_k=4, q_start=0, k_start=0),
    Case("causal_sq_gt_sk_offset", CAUSAL, s_q=12, s_k=3, q_start=5, k_start=6),
    Case("window_left_only", BlockMask(causal=False, window=(3, -1)), q_start=8, k_start=4),
    Case("window_right_only", BlockMask(causal=False, window=(-1, 2)), q_start=0, k_start=3),
    Case("window_both", BlockMask(causal=False, window=(2, 3)), s_q=7, s_k=9, q_start=5, k_start=2),
    Case("window_both_tall", BlockMask(causal=False, window=(4, 1)), s_q=13, s_k=4, q_start=0, k_start=2),
    Case("causal_window_mid_block", BlockMask(causal=True, window=(4, -1)), q_start=8, k_start=0),
    Case("causal_window_tall", BlockMask(causal=True, window=(5, -1)), s_q=12, s_k=3, q_start=3, k_start=2),
    Case("gqa", CAUSAL, h_q=4, h_kv=2, q_start=4, k_start=0, b=2),
    Case("mqa_window", BlockMask(causal=False, window=(2, 2)), h_q=3, h_kv=1, q_start=3, k_start=0),
    Case("mla_dqk_gt_dv", CAUSAL, d_qk=12, d_v=8, q_start=20, k_start=16),
    Case("mla_dqk_lt_dv", BlockMask(causal=True, window=(3, -1)), d_qk=6, d_v=10, q_start=6, k_start=2),
    Case("single_query", CAUSAL, s_q=1, s_k=9, q_start=8, k_start=0, h_q=4, h_kv=2),
]


def make_inputs(case: Case, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    q = rnd(case.b, case.s_q, case.h_q, case.d_qk)
    k = rnd(case.b, case.s_k, case.h_kv, case.d_qk)
    v = rnd(case.b, case.s_k, case.h_kv, case.d_v)
    dout = rnd(case.b, case.s_q, case.h_q, case.d_v)
    return q, k, v, dout


def visible_pairs(mask: BlockMask, q_start: int, s_q: int, k_start: int, s_k: int) -> torch.Tensor:
    """``[s_q, s_k]`` bool, written from BlockMask's definition independently of its methods
    (the attention oracle itself is :func:`tests.oracle.attention`)."""
    q_pos = torch.arange(q_start, q_start + s_q)[:, None]
    k_pos = torch.arange(k_start, k_start + s_k)[None, :]
    left, right = mask.window
    seen = torch.ones(s_q, s_k, dtype=torch.bool)
    if mask.causal:
        seen &= k_pos <= q_pos
    elif right >= 0:
        seen &= k_pos <= q_pos + right
    if left >= 0:
        seen &= k_pos >= q_pos - left
    return seen
