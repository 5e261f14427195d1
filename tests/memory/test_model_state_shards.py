"""The distributed optimizer over streamed model states (:mod:`megatron_longctx.memory.model_state_shards`):
each rank keeps Adam's moments for one contiguous range of every unit and updates only it; the ranges are
all-gathered into every rank's off-device weights.  Against ``torch.optim.AdamW`` on a plain copy whose
gradients are averaged the same way, bit for bit, at 2 and 4 ranks, with the costs counted."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from megatron_longctx.memory.host_pool import HostPool
from megatron_longctx.memory.model_state_shards import Shards
from megatron_longctx.memory.model_states import ModelStateStreamer, StreamOptions
from megatron_longctx.memory.offdevice_optimizer import OffDeviceAdamW, OffDeviceSpec
from tests.dist import run_ranks
from tests.memory.test_model_states import Stack, _loss

CHUNK = 1024  # elements per staging chunk: a parameter's range spans several
LENT = 1000  # bytes of each slot lent to the gathers: every unit's ranges travel in several uneven chunks


@contextlib.contextmanager
def _lent(streamer: ModelStateStreamer):
    with streamer.idle_slots() as (recv, send):
        yield recv[:LENT], send[:LENT]


def _owned(streamer: ModelStateStreamer, shards: Shards) -> dict:
    return {id(p.param): shards.owned(u.index, k) for u in streamer.units for k, p in enumerate(u.params)}


def _step(model, ref, streamer, shards, opt, ref_opt, target: str, seed: int) -> None:
    """One step of both on this rank's batch; afterwards every rank's streamed weights equal the reference's."""
    world = dist.get_world_size()
    tokens = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(seed))
    _loss(model, tokens).backward()
    streamer.finish_backward()
    _loss(ref, tokens).backward()
    for p in ref.parameters():  # the streamer's reduction: scaled, then summed over the ranks
        p.grad.mul_(1.0 / world)
        dist.all_reduce(p.grad)
    if target == "host":  # as Megatron's FP32Optimizer: the accumulated main gradient is the gradient
        for p in model.parameters():
            p.grad = p.main_grad
    before = shards.gathered_elements
    opt.step()
    streamer.gather_weights(shards)
    assert shards.gathered_elements - before == sum(part * world for part in shards.part)  # each unit once
    assert 0 < shards.largest_gather_bytes <= LENT  # through the lent slots, in chunks, nothing else
    ref_opt.step()
    ref_opt.zero_grad()
    for p in model.parameters():
        p.grad = None
    streamer.zero_grad()
    for i, unit in enumerate(ref.units()):
        for w, p_ref in zip(streamer.unit_weights(i), unit.parameters()):
            assert_close(w, p_ref.detach(), rtol=0, atol=0)


def _sharded_steps(target: str, steps: int = 3) -> None:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = Stack(h=24, n=3, vocab=40)  # units of 960 and 2,400 elements: at 4 ranks ranges end inside weights
    ref = copy.deepcopy(model)
    root = tempfile.mkdtemp(prefix=f"shards-{rank}-")
    opts = StreamOptions(target=target, device=torch.device("cpu"), pool=HostPool(1 << 24, pin=False),
                         disk_dir=os.path.join(root, "states") if target == "disk" else None,
                         reduce_group=dist.group.WORLD, grad_scale=1.0 / world)
    streamer = ModelStateStreamer(model.units(), opts)
    shards = Shards([[p.param.numel() for p in u.params] for u in streamer.units], dist.group.WORLD,
                    lambda: _lent(streamer))
    spec = OffDeviceSpec(target=target, pool=HostPool(1 << 22, pin=False), chunk_numel=CHUNK,
                         disk_dir=os.path.join(root, "opt") if target == "disk" else None,
                         source=streamer if target == "disk" else None, owned=_owned(streamer, shards))
    opt = OffDeviceAdamW(list(model.parameters()), spec, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)

    # the cost: each unit's elements are kept by exactly one rank, at most ceil(N / world) per rank and unit
    total = sum(p.numel() for p in model.parameters())
    kept = torch.tensor([opt.moment_elements])
    dist.all_reduce(kept)
    assert kept.item() == total
    assert opt.moment_elements == sum(shards.owned_numel(u.index) for u in streamer.units)
    assert opt.moment_elements <= sum(-(-sum(n) // world) for n in shards.numels)

    for step in range(steps):
        _step(model, ref, streamer, shards, opt, ref_opt, target, seed=100 * step + rank)

    # a checkpoint: every rank's moments gathered whole equal torch's AdamW's
    (whole,) = shards.whole_moments([opt], [[p.param for p in u.params] for u in streamer.units])
    with pytest.raises(RuntimeError, match="gathers every rank's first"):
        opt.state_dict()
    opt.set_gathered(whole)
    saved = opt.state_dict()
    opt.set_gathered(None)
    want = ref_opt.state_dict()
    for i, state in want["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert_close(saved["state"][i][key], state[key], rtol=0, atol=0)

    # loaded back, each rank keeps its range, and the next step still equals torch's
    opt.load_state_dict(saved)
    assert opt.moment_elements == sum(shards.owned_numel(u.index) for u in streamer.units)
    _step(model, ref, streamer, shards, opt, ref_opt, target, seed=999 + rank)
    opt.close()
    streamer.remove()
    shutil.rmtree(root)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("target", ["host", "disk"])
def test_sharded_adamw_equals_adamw_and_keeps_one_range_per_rank(world_size: int, target: str) -> None:
    run_ranks(world_size, _sharded_steps, target)
