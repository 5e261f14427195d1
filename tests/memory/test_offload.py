"""Activation offload (host / disk, every policy) keeps the plain model's loss and gradients.

Plain-torch cases check the mechanics (storages written once, views and shared tensors once,
parameters never, the device copy released once on disk, the host pool bound); GPTModel cases check
every policy on Megatron, micro-batches in flight, and composition with recompute.
"""

import gc
import os
import weakref

import pytest
import torch

from megatron_longctx.memory import MemoryConfig, hooks
from megatron_longctx.memory.host_pool import HostPool
from megatron_longctx.memory.offload import ActivationOffloader
from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import ORACLE, assert_same, build_gpt, cpu, loss_and_grads


def _chain(x, w, offloader, layers=3):
    """``layers`` tanh(x @ w) steps; each step's saved tensors belong to one layer scope."""
    probe = None
    with hooks.packing(offloader) if offloader is not None else _null():
        for i in range(layers):
            with hooks.layer_scope(i):
                y = x @ w  # saves x (activation) and w (parameter)
                x = torch.tanh(y) + y.t().t()  # tanh saves its output
                if i == 0:
                    probe = weakref.ref(x)  # saved only by the next layer's matmul
    return x, probe


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _grads(offloader, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 64, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.float64, generator=g) / 8)
    out, probe = _chain(x, w, offloader)
    if offloader is not None:
        offloader.synchronize()
        gc.collect()
    alive = probe() is not None
    loss = (out ** 2).sum()
    loss.backward()
    return (loss.detach(), {"x": x.grad, "w": w.grad}), alive


def test_disk_offload_releases_activations_and_restores_them(tmp_path):
    ref, alive = _grads(None)
    assert alive  # without offload the saved activation stays in memory
    cfg = MemoryConfig(offload_policy="layers", offload_target="disk", offload_min_bytes=0,
                       offload_disk_dir=str(tmp_path))
    off = ActivationOffloader(cfg, params=())
    got, alive = _grads(off)
    assert not alive, "the offloaded activation is still resident"
    assert_same(ref, got)
    assert off.stats.offloaded_bytes > 0 and off.stats.fetched_bytes >= off.stats.offloaded_bytes
    gc.collect()
    off.synchronize()
    run_dir = off.disk_dir
    assert os.path.dirname(run_dir) == str(tmp_path)
    assert sorted(os.listdir(run_dir)) == [".lock"]  # files are removed once backward has used them
    off.close()
    assert os.listdir(tmp_path) == []  # and the run directory at close


def test_parameters_are_never_offloaded():
    w_param = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.float64))
    cfg = MemoryConfig(offload_policy="layers", offload_target="disk", offload_min_bytes=0)
    off = ActivationOffloader(cfg, params=(w_param,))
    x = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    with hooks.packing(off), hooks.layer_scope(0):
        y = x @ w_param  # saves x and w_param
        z = y @ w_param.t()  # saves y and a view of w_param
    off.synchronize()
    assert off.stats.offloaded_tensors == 2 and off.stats.offloaded_bytes == 2 * 64 * 64 * 8
    z.sum().backward()
    ref_x = torch.ones(64, 64, dtype=torch.float64) @ w_param.detach() @ w_param.detach().t()
    torch.testing.assert_close(x.grad, ref_x)
    off.close()


def test_views_and_shared_tensors_travel_once():
    cfg = MemoryConfig(offload_policy="layers", offload_target="disk", offload_min_bytes=0)
    off = ActivationOffloader(cfg)
    a = torch.randn(32, 32, dtype=torch.float64, requires_grad=True)
    base = torch.tanh(a)  # tanh saves its output: base
    with hooks.packing(off):
        with hooks.layer_scope(0):
            p = base * base.t()  # saves base and its transposed view
        with hooks.layer_scope(1):
            q = base.exp()  # another layer saves base's output again
            r = q * base  # saves q and base
    off.synchronize()
    assert off.stats.offloaded_bytes == 2 * 32 * 32 * 8  # base once, q once
    assert off.stats.deduplicated_bytes == 3 * 32 * 32 * 8
    (p.sum() + r.sum()).backward()
    a2 = a.detach().clone().requires_grad_()  # plain autograd, nothing offloaded
    base2 = torch.tanh(a2)
    ((base2 * base2.t()).sum() + (base2.exp() * base2).sum()).backward()
    torch.testing.assert_close(a.grad, a2.grad)
    off.close()


def test_host_target_on_cpu_is_counted_not_pretended():
    cfg = MemoryConfig(offload_policy="layers", offload_target="host", offload_min_bytes=0)
    off = ActivationOffloader(cfg)
    (loss, grads), alive = _grads(off)
    assert alive  # a CPU tensor offloaded "to host" stays where it is
    assert off.stats.offloaded_bytes == 0 and off.stats.host_noop_bytes > 0
    ref, _ = _grads(None)
    assert_same(ref, (loss, grads))


def test_host_pool_is_bounded():
    pool = HostPool(capacity=1000)
    a = pool.take(600)
    assert a is not None and pool.take(600) is None  # past the bound: the caller keeps the tensor
    pool.give(a)
    b = pool.take(600)
    assert b is a  # reused by size
    with pytest.raises(ValueError, match="--longctx-offload-policy"):
        ActivationOffloader(MemoryConfig(offload_policy="none"))


def test_min_bytes_threshold():
    cfg = MemoryConfig(offload_policy="layers", offload_target="disk", offload_min_bytes=64 * 64 * 8 + 1)
    off = ActivationOffloader(cfg)
    _grads(off)
    assert off.stats.offloaded_tensors == 0
    off.close()


# ----------------------------------------------------------------------------- Megatron GPTModel

GPT_CASES = [
    MemoryConfig(recompute_granularity="full", offload_policy="checkpoint", offload_target="disk", offload_min_bytes=0),
    MemoryConfig(recompute_granularity="full", recompute_method="block", recompute_num_layers=1,
                 offload_policy="checkpoint", offload_target="disk", offload_min_bytes=0),
    MemoryConfig(offload_policy="modules", offload_modules=("core_attn", "mlp", "qkv", "proj", "layernorm"),
                 offload_target="disk", offload_min_bytes=0),
    MemoryConfig(offload_policy="layers", offload_num_layers=1, offload_target="disk", offload_min_bytes=0),
    MemoryConfig(offload_policy="layers", offload_target="disk", offload_min_bytes=0, offload_prefetch=False,
                 offload_max_inflight=1),
    MemoryConfig(recompute_granularity="selective", recompute_modules=("core_attn", "layernorm"),
                 offload_policy="modules", offload_modules=("mlp",), offload_target="disk", offload_min_bytes=0),
    MemoryConfig(recompute_granularity="full", offload_policy="checkpoint", offload_target="host", offload_min_bytes=0),
]


GPT_CASE_IDS = ["full-checkpoint-disk", "full-block1-checkpoint-disk", "modules-all-disk", "layers1-disk",
                "layers-unprefetched-disk", "selective-with-modules-disk", "full-checkpoint-host"]


def _policies_match_plain(cfg):
    from megatron_longctx.megatron.memory_spec import install

    with cpu(), megatron_parallel(tp=2):
        ref = loss_and_grads(build_gpt(**ORACLE))
        model = build_gpt(**ORACLE)
        handle = install(model, cfg)
        got = loss_and_grads(model)
        assert_same(ref, got)
        stats = handle.offloader.stats
        if cfg.offload_target == "disk":
            assert stats.offloaded_bytes > 0 and stats.fetched_bytes > 0, (cfg, stats)
        else:
            assert stats.host_noop_bytes > 0 and stats.offloaded_bytes == 0, (cfg, stats)
        handle.remove()


@pytest.mark.parametrize("cfg", GPT_CASES, ids=GPT_CASE_IDS)
def test_every_policy_matches_plain_model_tp2(cfg):
    run_ranks(2, _policies_match_plain, cfg)


def _microbatches_in_flight():
    """Forward micro-batches 0, 1, 2 before any backward (a pipeline stage's warm-up), then backward."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_longctx.megatron.memory_spec import install
    from tests.gpt_kit import ORACLE_SEQ, batch

    def run(model, in_flight=None):
        torch.manual_seed(5)
        model_parallel_cuda_manual_seed(5)
        losses = []
        for mb in range(3):
            b = batch(seed=mb, seq=ORACLE_SEQ)
            tokens, pos = b["tokens"], b["position_ids"]
            losses.append(model(tokens, pos, None, labels=tokens).double().mean())
        if in_flight is not None:
            in_flight()
        for loss in losses:  # first in, first out, as 1F1B
            loss.backward()
        return torch.stack(losses).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    with cpu(), megatron_parallel(tp=2):
        ref = run(build_gpt(**ORACLE))
        for cfg in (MemoryConfig(recompute_granularity="full", offload_policy="checkpoint", offload_target="disk",
                                 offload_min_bytes=0),
                    MemoryConfig(offload_policy="layers", offload_target="disk", offload_min_bytes=0)):
            model = build_gpt(**ORACLE)
            handle = install(model, cfg)
            keys = set()
            got = run(model, lambda: keys.update(handle.offloader._groups))
            assert_same(ref, got)
            assert {mb for mb, _ in keys} == {1, 2, 3} and {layer for _, layer in keys} == {0, 1}, keys
            assert not handle.offloader._groups  # every group was fetched back
            handle.remove()


def test_microbatches_in_flight_are_keyed_apart():
    run_ranks(2, _microbatches_in_flight)


_POOL_RSS = """
import os, sys, torch
sys.path.insert(0, {root!r})
from megatron_longctx.memory.host_pool import HostPool

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

pool = HostPool(16 << 20, pin=False)
torch.empty(3 << 20, dtype=torch.uint8).fill_(1)  # torch's own first-use memory (threads, kernels) before the base
base = rss()
peak = 0
for i in range(300):  # 300 different sizes of 1..3 MiB, each written (as a copy would) and given back
    buf = pool.take((1 << 20) + i * 7 * 1024)
    if buf is not None:
        buf.fill_(1)
        pool.give(buf)
    assert pool.held <= 16 << 20
    peak = max(peak, rss() - base)
print(peak, pool.held, pool.evicted_bytes, pool.refused)
"""


def test_host_pool_bound_counts_cached_buffers_rss():
    """16 MiB bound, buffers of 300 sizes taken and given back: what the process keeps stays under it."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # each buffer its own mapping: RSS = what is held
    proc = subprocess.run([sys.executable, "-c", _POOL_RSS.format(root=root)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    peak, held, evicted, refused = map(int, proc.stdout.split())
    assert held <= 16 << 20 and evicted > 250 << 20 and refused == 0
    assert peak <= (16 << 20) + (4 << 20), f"RSS grew by {peak / 2**20:.1f} MiB with a 16 MiB pool"


def test_host_pool_refuses_past_the_bound_and_evicts_other_sizes():
    pool = HostPool(capacity=1000, pin=False)
    a = pool.take(600)
    assert pool.take(500) is None and pool.refused == 1  # 600 handed out + 500 > 1000
    pool.give(a)
    b = pool.take(500)  # the cached 600 is freed to make room
    assert b is not None and pool.cached == 0 and pool.evicted_bytes == 600 and pool.held == 500


def test_pinned_pool_charges_the_rounded_block():
    """Pinned blocks are powers of two in PyTorch's host allocator: the bound counts what they hold."""
    pool = HostPool(capacity=4096, pin=True)
    assert pool.charge(3000) == 4096 and pool.charge(4096) == 4096 and pool.charge(1) == 1
    assert HostPool(capacity=4096, pin=False).charge(3000) == 3000


def test_a_pinned_pool_empties_torchs_host_cache_only_when_cleared(monkeypatch):
    """Eviction mid-forward leaves torch's cached pinned blocks alone (emptying them syncs the device and
    drops every other owner's blocks); :meth:`HostPool.clear` gives them back."""
    emptied = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append(1), raising=False)  # torch < 2.14 has none

    class Pinned(HostPool):
        def _new(self, nbytes):  # a CPU stand-in for a pinned block
            return torch.empty(nbytes, dtype=torch.uint8)

    pool = Pinned(capacity=1024, pin=True)
    pool.give(pool.take(600))
    assert pool.take(500) is not None and pool.evicted_bytes == 1024
    assert emptied == []
    pool.clear()
    assert emptied == [1]
