"""The spawn harness itself: ranks run, collectives work, failures and hangs surface with tracebacks."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.dist import RankFailure, megatron_parallel, run_ranks


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_run_collectives(world_size):
    got = run_ranks(world_size, _all_reduce_rank)
    expected_sum = world_size * (world_size + 1) / 2
    assert got == [(r, world_size, expected_sum) for r in range(world_size)]


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 waits here for a peer that never comes


def test_failing_rank_traceback_surfaces():
    with pytest.raises(RankFailure) as err:
        run_ranks(2, _fail_on_rank_one, timeout=60)
    text = str(err.value)
    assert "ValueError: boom from rank one" in text and "rank 1" in text
    assert "rank 0" in text  # the rank left waiting is reported, not left hanging


def _sleep_forever():
    import time

    time.sleep(3600)


def test_hang_is_a_failure():
    with pytest.raises(RankFailure, match="timed out"):
        run_ranks(2, _sleep_forever, timeout=5)
    assert run_ranks(2, _all_reduce_rank)[0][2] == 3.0  # the next test gets a fresh, working pool


def _megatron_groups(tp, cp):
    with megatron_parallel(tp=tp, cp=cp) as ps:
        return ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()


@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 2), (1, 4)])
def test_megatron_parallel_state(tp, cp):
    assert run_ranks(4, _megatron_groups, tp, cp) == [(tp, cp)] * 4


def _set_env(name):
    seen = os.environ.get(name)
    os.environ[name] = "0"
    return seen


def test_environment_does_not_leak_between_tasks():
    """Megatron's models set NVTE_* flags; a reused rank starts each task with the environment it began with."""
    name = "LONGCTX_TEST_LEAK_PROBE"
    assert run_ranks(2, _set_env, name) == [None, None]
    assert run_ranks(2, _set_env, name) == [None, None]
