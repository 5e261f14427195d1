"""The all-to-alls of Ulysses and the hybrid land in place for one document and one batch row.

``seq_to_heads(..., halves=True)`` sends each of a rank's two chunks in its own all-to-all straight
into the coarse shard; it must give exactly the tensor of the general path (one all-to-all, then the
reordering gather), and ``heads_to_seq`` must invert it, for Ulysses (``U = cp``) and for groups of
``U < cp`` ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_longctx.attention.a2a_ring import heads_to_seq, in_halves, seq_to_heads
from megatron_longctx.attention.layout import SeqLayout, pooled_index
from tests.dist import run_ranks


def _body(u: int, chunk: int) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(g, g + u))) for g in range(0, world, u)]
    group = groups[rank // u]
    layout = SeqLayout.dense(2 * world * chunk, world)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(1, layout.local_len, 2 * u, 3, generator=gen, dtype=torch.float64)  # [b, t, h, d]
    assert in_halves(layout, x) and not in_halves(layout, x.expand(2, -1, -1, -1))
    index = pooled_index(layout, u)
    want = seq_to_heads(x, group, index)
    got = seq_to_heads(x, group, index, halves=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(heads_to_seq(got, group, index, halves=True), x, rtol=0, atol=0)
    torch.testing.assert_close(heads_to_seq(want, group, index), x, rtol=0, atol=0)


@pytest.mark.parametrize("world,u", [(2, 2), (4, 4), (4, 2)], ids=["ulysses-cp2", "ulysses-cp4", "hybrid-cp4-u2"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_halves_match_general_path(world: int, u: int, chunk: int) -> None:
    run_ranks(world, _body, u, chunk)
