"""The all-to-alls of Ulysses and the hybrid: in place for one document and one batch row, packed for short shards.

``seq_to_heads(..., halves=True)`` sends each of a rank's two chunks in its own all-to-all straight
into the coarse shard; it must give exactly the tensor of the general path (one all-to-all, then the
reordering gather), and ``heads_to_seq`` must invert it, for Ulysses (``U = cp``) and for groups of
``U < cp`` ranks.  ``seq_to_heads_packed`` moves several tensors of different heads and head dims in
one all-to-all: exactly the general path's tensors, inverted by ``heads_to_seq_packed``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_longctx.attention.ulysses import (
    heads_to_seq,
    heads_to_seq_packed,
    in_halves,
    seq_to_heads,
    seq_to_heads_packed,
)
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


def _packed_body(u: int, chunk: int, batch: int) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(g, g + u))) for g in range(0, world, u)]
    group = groups[rank // u]
    layout = SeqLayout.dense(2 * world * chunk, world)
    gen = torch.Generator().manual_seed(rank)
    t = layout.local_len  # q [b, t, 2U, 5], k [b, t, U, 5], v [b, t, U, 3] (MLA: d_v != d_qk)
    xs = [torch.randn(batch, t, h, d, generator=gen, dtype=torch.float64) for h, d in ((2 * u, 5), (u, 5), (u, 3))]
    index = pooled_index(layout, u)
    got = seq_to_heads_packed(xs, group, index)
    for g, x in zip(got, xs):
        torch.testing.assert_close(g, seq_to_heads(x, group, index), rtol=0, atol=0)
    for back, x in zip(heads_to_seq_packed(got, group, index), xs):
        torch.testing.assert_close(back, x, rtol=0, atol=0)


@pytest.mark.parametrize("world,u", [(2, 2), (4, 4), (4, 2)], ids=["ulysses-cp2", "ulysses-cp4", "hybrid-cp4-u2"])
@pytest.mark.parametrize("chunk,batch", [(1, 1), (3, 2)])
def test_packed_all_to_all_matches_one_tensor_at_a_time(world: int, u: int, chunk: int, batch: int) -> None:
    run_ranks(world, _packed_body, u, chunk, batch)
