"""The distributed optimizer over streamed model states (:mod:`megatron_longctx.memory.model_state_shards`):
each rank receives the sum of its contiguous range of every unit's gradients (a reduce-scatter), keeps
Adam's moments for that range and updates only it; the ranges are all-gathered into every rank's off-device
weights.  Against ``torch.optim.AdamW`` on a plain copy whose gradients are averaged the same way (bit for
bit at 2 ranks, to float32 rounding at 4), with the costs counted."""

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


def _tolerance(world: int) -> dict:
    """Two ranks sum a + b whichever collective does it: bit for bit.  Four: gloo's reduce-scatter adds in
    another order than the reference's all-reduce, so float32 rounding."""
    return dict(rtol=0, atol=0) if world == 2 else {}


def _step(model, ref, streamer, shards, opt, ref_opt, target: str, seed: int) -> None:
    """One step of both on this rank's batch; afterwards every rank's streamed weights equal the reference's."""
    world = dist.get_world_size()
    tol = _tolerance(world)
    tokens = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(seed))
    scattered = shards.scattered_elements
    _loss(model, tokens).backward()
    streamer.finish_backward()
    assert shards.scattered_elements - scattered == sum(part * world for part in shards.part)  # each unit once
    assert streamer.scratch_allocations == 0  # each through its own idle weight slot
    _loss(ref, tokens).backward()
    for p in ref.parameters():  # the streamer's reduction: scaled, then summed over the ranks
        p.grad.mul_(1.0 / world)
        dist.all_reduce(p.grad)
    # the reduce-scatter: this rank's range holds the sum, every other element zero
    for i, unit in enumerate(ref.units()):
        for k, (g, p_ref) in enumerate(zip(streamer.unit_grads(i), unit.parameters())):
            lo, hi = shards.owned(i, k)
            want = torch.zeros(p_ref.numel())
            want[lo:hi] = p_ref.grad.reshape(-1)[lo:hi]
            assert_close(g.reshape(-1), want, **tol)
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
            assert_close(w, p_ref.detach(), **tol)


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
    streamer.shards = shards  # the gradients reduce-scattered: each rank sums its range only
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
            assert_close(saved["state"][i][key], state[key], **_tolerance(world))

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


def _micro_batches() -> None:
    """Three micro-batches summed over the ranks with ``grad_scale`` 1 (each summed as it ends, as Megatron
    without --overlap-grad-reduce has it, or only the last, under no_sync), whole or reduce-scattered: the
    accumulator holds the sum over ranks and micro-batches (in this rank's range, zero elsewhere)."""
    rank = dist.get_rank()
    for target in ("host", "disk"):
        for sharded in (False, True):
            for each in (True, False):
                torch.manual_seed(0)
                model = Stack(h=24, n=3, vocab=40)
                ref = copy.deepcopy(model)
                root = tempfile.mkdtemp(prefix=f"micro-{rank}-")
                opts = StreamOptions(target=target, device=torch.device("cpu"), pool=HostPool(1 << 24, pin=False),
                                     disk_dir=os.path.join(root, "states") if target == "disk" else None,
                                     reduce_group=dist.group.WORLD, grad_scale=1.0)
                streamer = ModelStateStreamer(model.units(), opts)
                shards = Shards([[p.param.numel() for p in u.params] for u in streamer.units], dist.group.WORLD,
                                lambda: _lent(streamer))
                streamer.shards = shards if sharded else None
                for mb in range(3):
                    streamer.sync_grads = each or mb == 2
                    tokens = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(10 * mb + rank))
                    _loss(model, tokens).backward()
                    streamer.finish_backward()
                    _loss(ref, tokens).backward()
                for p in ref.parameters():
                    dist.all_reduce(p.grad)
                for i, unit in enumerate(ref.units()):
                    for k, (g, p_ref) in enumerate(zip(streamer.unit_grads(i), unit.parameters())):
                        want = p_ref.grad.reshape(-1).clone()
                        if sharded:
                            lo, hi = shards.owned(i, k)
                            want[:lo], want[hi:] = 0, 0
                        assert_close(g.reshape(-1), want, msg=lambda m: f"{target} sharded={sharded} each={each}: {m}")
                streamer.remove()
                shutil.rmtree(root)


def test_micro_batches_summed_as_each_ends_or_only_the_last_give_the_sum() -> None:
    run_ranks(2, _micro_batches)
