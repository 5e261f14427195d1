"""The offloader's CUDA stream contract, proven on the CPU with a recording test double.

What CPU can show about the GPU path: the order of wait_stream / copy / record_event / record_stream /
free for every offloaded storage (out and back), that the offloader lets go of each device copy at
once and keeps no device copy of any layer (the last one included) into backward, that the pending
copies stay bounded across micro-batches and steps with nobody polling, that restored buffers are
compute-stream allocations, and that gradients equal plain autograd's.
"""

import gc

import torch

from megatron_longctx.memory import MemoryConfig, hooks
from megatron_longctx.memory.offload import ActivationOffloader
from tests.memory.fake_streams import RecordingOps

CFG = dict(offload_policy="layers", offload_target="host", offload_min_bytes=0)


def _forward(offloader, layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 32, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(32, 32, dtype=torch.float64, generator=g) / 6)
    h = x
    with hooks.packing(offloader) if offloader is not None else _nothing():
        for i in range(layers):
            with hooks.layer_scope(i):
                h = torch.tanh(h @ w)  # saves h (input), w (parameter, excluded) and the tanh output
    return x, w, (h ** 2).sum()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _plain(layers=3, seed=0):
    x, w, loss = _forward(None, layers, seed)
    loss.backward()
    return loss.detach(), x.grad, w.grad


def _sources(log):
    """Names of the device copies the offloader copied to the host (forward copies on the side stream)."""
    restored = _restored(log)
    return [e[2] for e in log if e[0] == "copy" and e[3] == "side" and e[1] not in restored]


def _restored(log):
    return {e[1] for e in log if e[0] == "empty"}


def test_stream_order_out_and_back_and_no_device_copy_into_backward():
    ops = RecordingOps(auto_land=False)  # no copy lands by itself: release must not wait for one
    off = ActivationOffloader(MemoryConfig(**CFG, offload_max_inflight=64), ops=ops)
    x, w, loss = _forward(off)
    gc.collect()
    forward_end = len(ops.log)
    srcs = _sources(ops.log)
    assert len(srcs) == off.stats.offloaded_tensors == 4  # x and each tanh output (a layer input is the previous output)
    for src in srcs:  # off the device: wait for compute, copy on side, event, record_stream, then let go
        i_copy = next(i for i, e in enumerate(ops.log) if e[0] == "copy" and e[2] == src)
        assert ops.log[i_copy - 1] == ("wait_stream", "side", "compute")
        assert ops.log[i_copy + 1][:2] == ("record_event", "side")
        assert ops.log[i_copy + 2] == ("record_stream", src, "side")
        assert ops.index(("free", src)) < forward_end  # no device copy of any layer reaches backward
    assert not any(e[0] in ("sync_event", "sync_stream") for e in ops.log)  # nothing waited in forward
    loss.backward()
    back = ops.log[forward_end:]
    bufs = [e[1] for e in back if e[0] == "empty"]
    assert len(bufs) == 4  # one device buffer per storage: no second copy
    copied = {e[2]: e[1] for e in ops.log[:forward_end] if e[0] == "copy"}  # src -> host buffer
    events_of_host = {ops.log[i][1]: ops.log[i + 1][2] for i in range(forward_end) if ops.log[i][0] == "copy"}
    for buf in bufs:
        i = next(j for j, e in enumerate(back) if e[:2] == ("empty", buf))
        assert back[i][2] == "compute"  # allocated on the compute stream, like the tensor autograd kept
        assert back[i + 1] == ("wait_stream", "side", "compute")
        assert back[i + 2][:2] == ("wait_event", "side") and back[i + 2][2] in events_of_host.values()
        host = back[i + 3][2]
        assert back[i + 3] == ("copy", buf, host, "side") and host in copied.values()
        fetched = back[i + 4][2]
        assert back[i + 4][:2] == ("record_event", "side")
        assert back[i + 5] == ("record_stream", buf, "side")
        assert ("wait_event", "compute", fetched) in back[i + 6:]  # before autograd reads it
    ref = _plain()
    torch.testing.assert_close(loss.detach(), ref[0])
    torch.testing.assert_close(x.grad, ref[1])
    torch.testing.assert_close(w.grad, ref[2])


def test_pending_copies_bounded_across_steps_without_polling():
    ops = RecordingOps(auto_land=False)
    bound = 2
    off = ActivationOffloader(MemoryConfig(**CFG, offload_max_inflight=bound), ops=ops)
    seen = []
    track = off.track_copy

    def tracked(event):
        track(event)
        seen.append(len(off.pending))

    off.track_copy = tracked
    steps = 5
    for step in range(steps):
        off.next_microbatch()
        x, w, loss = _forward(off, seed=step)
        loss.backward()
        ref = _plain(seed=step)
        torch.testing.assert_close(x.grad, ref[1])
    assert max(seen) == bound and len(seen) == 4 * steps
    assert len(ops.entries("sync_event")) == 4 * steps - bound  # each copy past the bound waited for
    assert off.stats.waited_copies == 4 * steps - bound


def test_pending_list_drains_as_copies_land():
    ops = RecordingOps(auto_land=True)
    off = ActivationOffloader(MemoryConfig(**CFG, offload_max_inflight=2), ops=ops)
    for step in range(3):
        off.next_microbatch()
        _, _, loss = _forward(off, seed=step)
        loss.backward()
    assert len(off.pending) <= 1 and not ops.entries("sync_event")  # landed copies are forgotten, none waited


def test_disk_target_stages_through_the_pool_and_writes_on_the_worker(tmp_path):
    ops = RecordingOps(auto_land=False)
    off = ActivationOffloader(MemoryConfig(offload_policy="layers", offload_target="disk", offload_min_bytes=0,
                                           offload_disk_dir=str(tmp_path)), ops=ops)
    x, w, loss = _forward(off)
    gc.collect()
    srcs = _sources(ops.log)
    assert len(srcs) == 4
    for src in srcs:
        i_copy = next(i for i, e in enumerate(ops.log) if e[0] == "copy" and e[2] == src)
        assert ops.log[i_copy + 2] == ("record_stream", src, "side")
    off.synchronize()  # the worker waited for each staged copy before writing it
    assert len(ops.entries("sync_event")) == 4
    assert off.pool.used == 0 and off.pool.cached > 0  # staging buffers went back to the pool
    loss.backward()
    ref = _plain()
    torch.testing.assert_close(x.grad, ref[1])
    torch.testing.assert_close(w.grad, ref[2])
    off.close()


def _wired_gpt_with_recorded_streams():
    """``memory.install`` on a GPTModel with the stream double: 3 steps, the parameters moved into one
    flat buffer after install (as DDP's buffer), against the plain model."""
    from megatron_longctx.megatron.memory_spec import install
    from megatron_longctx.memory import streams
    from tests.gpt_kit import ORACLE, assert_same, build_gpt, cpu, loss_and_grads
    from tests.dist import megatron_parallel

    with cpu(), megatron_parallel(tp=2):
        ref = loss_and_grads(build_gpt(**ORACLE), steps=3)
        ops = RecordingOps(auto_land=False)
        original = streams.device_ops
        streams.device_ops = lambda: ops
        try:
            model = build_gpt(**ORACLE)
            cfg = MemoryConfig(recompute_granularity="full", offload_policy="checkpoint", offload_target="host",
                               offload_min_bytes=0, offload_max_inflight=2)
            handle = install(model, cfg)
        finally:
            streams.device_ops = original
        params = list(model.parameters())
        flat = torch.cat([p.detach().reshape(-1) for p in params])  # one buffer, as DDP's param buffer
        offset = 0
        for p in params:
            p.data = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        pending = []
        off = handle.offloader
        track = off.track_copy
        off.track_copy = lambda e: (track(e), pending.append(len(off.pending)))
        got = loss_and_grads(model, steps=3)
        assert_same(ref, got)
        srcs = _sources(ops.log)
        # per step: each of the 2 layers' input, and the RoPE table once (layer 1's is the same storage)
        assert len(srcs) == off.stats.offloaded_tensors == 3 * 3 and off.stats.deduplicated_bytes > 0
        first_restore = next(i for i, e in enumerate(ops.log) if e[0] == "empty")
        assert all(ops.index(("free", s)) < first_restore for s in srcs[:3])  # step 1: none into backward
        assert max(pending) == 2 and off.stats.waited_copies == 9 - 2  # bounded across steps, nobody polled
        assert flat.untyped_storage().data_ptr() in off._params_ptrs() and off.stats.param_refreshes >= 3
        handle.remove()


def test_install_wiring_with_recorded_streams_tp2():
    from tests.dist import run_ranks

    run_ranks(2, _wired_gpt_with_recorded_streams)
