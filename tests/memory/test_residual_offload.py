"""The residual gradient streamed between tiled layer replays (``--longctx-offload-residual-grad``) keeps
the gradients exact: float64 oracle, the same layers run whole; on pinned-host and disk targets, with a
second consumer of the streamed tensor, a hook on it, and a second backward."""

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_longctx.memory import MemoryConfig, residual_offload, tiled_recompute
from tests.memory.test_tiled_recompute import _ToyLayer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, BATCH, HIDDEN = 19, 2, 16


class _Spy:
    """Counts the streams handed over from one backward to the next."""

    def __init__(self, monkeypatch):
        self.handed = 0
        original = residual_offload.hand_over

        def hand_over(consumer, stream):
            self.handed += 1
            return original(consumer, stream)

        monkeypatch.setattr(residual_offload, "hand_over", hand_over)


def _model(target, extra_use=False, hook=False, tiles=5):
    """Three toy layers; the loss also reads the middle residual tensor when ``extra_use``."""
    torch.manual_seed(2)
    layers = [_ToyLayer() for _ in range(3)]
    x0 = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.float64)
    seen = []

    def run():
        for layer in layers:
            layer.zero_grad()
        h = x0 * 1.5
        middle = None
        for i, layer in enumerate(layers):
            if tiles:
                h, _ = tiled_recompute.tiled_checkpoint(layer, tiles, layer.parameters, h, port=layer.replay_port,
                                                        grad_target=target)
            else:
                h, _ = layer(h)
            if i == 1:
                middle = h
                if hook:
                    h.register_hook(lambda g: seen.append(g.clone()))
        loss = (h * dy).sum()
        if extra_use:
            loss = loss + (middle.sin() * dy).sum()
        return loss

    def grads(loss, retain_graph=False):
        params = [x0, *(p for layer in layers for p in layer.parameters())]
        return list(torch.autograd.grad(loss, params, retain_graph=retain_graph))

    return run, grads, seen


@pytest.mark.parametrize("where", ["host", "disk"])
@pytest.mark.parametrize("extra_use", [False, True])
def test_streamed_gradient_matches_float64(where, extra_use, tmp_path, monkeypatch):
    target = residual_offload.Target(str(tmp_path) if where == "disk" else None)
    spy = _Spy(monkeypatch)
    run_ref, grads_ref, _ = _model(target, extra_use, tiles=0)
    ref = grads_ref(run_ref())
    run, grads, _ = _model(target, extra_use)
    got = grads(run())
    assert spy.handed == 2  # layer 3 -> layer 2 -> layer 1; layer 1's input comes from a plain op
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    if where == "disk":
        assert list(tmp_path.iterdir()) == []  # the streams' files are unlinked from the start


def test_a_hooked_residual_tensor_is_not_streamed(monkeypatch):
    spy = _Spy(monkeypatch)
    run_ref, grads_ref, seen_ref = _model(residual_offload.Target(), hook=True, tiles=0)
    ref = grads_ref(run_ref())
    run, grads, seen = _model(residual_offload.Target(), hook=True)
    got = grads(run())
    assert spy.handed == 1  # layer 3 -> 2 streams; the hooked output of layer 2 gets a real gradient
    torch.testing.assert_close(seen[0], seen_ref[0], rtol=1e-10, atol=1e-12)
    assert seen[0].abs().sum() > 0
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_a_second_backward_streams_again(monkeypatch):
    spy = _Spy(monkeypatch)
    run_ref, grads_ref, _ = _model(residual_offload.Target(), tiles=0)
    ref = grads_ref(run_ref())
    run, grads, _ = _model(residual_offload.Target())
    loss = run()
    first = grads(loss, retain_graph=True)
    second = grads(loss)
    assert spy.handed == 4
    for a, b, r in zip(first, second, ref):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(b, r, rtol=1e-10, atol=1e-12)


def test_the_flag_needs_tiled_replay_and_an_offload_policy():
    with pytest.raises(ValueError, match="--longctx-offload-residual-grad.*--longctx-recompute-tiles"):
        MemoryConfig(recompute_granularity="full", offload_policy="checkpoint", offload_residual_grad=True)
    with pytest.raises(ValueError, match="--longctx-offload-residual-grad"):
        MemoryConfig(recompute_granularity="full", recompute_tiles=4, offload_residual_grad=True)
    MemoryConfig(recompute_granularity="full", recompute_tiles=4, offload_policy="checkpoint",
                 offload_residual_grad=True)


def test_a_file_size_limit_names_the_flag_in_a_child(tmp_path):
    """Real faults under RLIMIT_FSIZE: a stream too large for the limit fails when it is made, and a row
    written past the limit fails when it is written; both name the flag, the errno and the directory."""
    code = textwrap.dedent(f"""
        import resource, signal, sys, torch
        sys.path.insert(0, {ROOT!r})
        from megatron_longctx.memory.residual_offload import ResidualGradOffload
        from megatron_longctx.memory.offload_disk import DiskOffloadError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the call then fails with EFBIG
        rows = torch.Size([1024, 16])  # 128 KiB of float64
        early = ResidualGradOffload(rows, torch.float64, torch.device("cpu"), {str(tmp_path)!r})
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        for what, step in (("made", lambda: ResidualGradOffload(rows, torch.float64, torch.device("cpu"), {str(tmp_path)!r})),
                           ("written", lambda: early.write(1000, 1024, torch.ones(24, 16, dtype=torch.float64)))):
            try:
                step()
            except DiskOffloadError as exc:
                print("ERROR", what, exc.errno, exc)
        early.write(0, 8, torch.ones(8, 16, dtype=torch.float64))  # under the limit: still fine
        assert torch.equal(early.read(0, 8), torch.ones(8, 16, dtype=torch.float64))
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert f"ERROR made {errno.EFBIG}" in out and f"ERROR written {errno.EFBIG}" in out, out + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 2 and all("--longctx-offload-disk-dir" in e and "EFBIG" in e and str(tmp_path) in e
                                    for e in errors), out
    assert out.rstrip().endswith("OK"), out + proc.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("where", ["host", "disk"])
def test_the_recomputing_tiled_loss_writes_its_hidden_gradient_to_a_stream(where, tmp_path):
    """The loss's hidden-state gradient, tile rows written to a stream (no norm inside the loss: the
    sequence-parallel case), equals autograd's through the plain float64 cross-entropy."""
    from megatron_longctx.memory import tiled_loss

    torch.manual_seed(4)
    s, b, h, vocab = 10, 2, 8, 32
    hidden = torch.randn(s, b, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, h, dtype=torch.float64)
    target = torch.randint(0, vocab, (s, b))
    grad_loss = torch.rand(s, b, dtype=torch.float64)
    per_token = torch.nn.functional.cross_entropy((hidden @ weight.t()).reshape(-1, vocab), target.reshape(-1),
                                                  reduction="none").reshape(s, b)
    (want,) = torch.autograd.grad((per_token * grad_loss).sum(), hidden)

    args = tiled_loss.TiledLossArgs(3, reduce_grad_input=False, recompute=True)
    _, lse, _, _ = tiled_loss.tiled_loss_forward(args, hidden.detach(), weight, target)
    stream = residual_offload.ResidualGradOffload(hidden.shape, hidden.dtype, hidden.device, str(tmp_path) if where == "disk" else None)
    got, _ = tiled_loss.tiled_loss_backward_recompute(args, hidden.detach(), weight, target, lse, grad_loss, (), stream)
    assert got is stream
    torch.testing.assert_close(stream.read(0, s), want, rtol=1e-12, atol=1e-12)


def _offloader(ops, pool_bytes=1 << 30):
    from megatron_longctx.memory.offload import ActivationOffloader

    cfg = MemoryConfig(recompute_granularity="full", recompute_tiles=4, offload_policy="checkpoint",
                       offload_residual_grad=True, offload_host_pool_bytes=pool_bytes)
    return ActivationOffloader(cfg, ops=ops)


def test_stream_rows_travel_on_the_side_stream_one_tile_ahead():
    """Through the offloader (recording double): a tile goes to the host on the side stream once compute has
    made it, and the compute stream never waits for that; reads come one tile ahead, each waited for alone."""
    from tests.memory.fake_streams import RecordingOps
    from tests.memory.test_offload_rows import TILES, assert_tiles_come_ahead

    ops = RecordingOps()
    off = _offloader(ops)
    x = torch.randn(16, 2, 4, dtype=torch.float64)
    stream = residual_offload.Target(offloader=off).new(x.shape, x.dtype, x.device)
    assert off.pool.used == x.numel() * 8  # the [s, b, h] buffer is the pool's
    start = len(ops.log)
    for lo, hi in TILES:
        stream.write(lo, hi, x[lo:hi].clone())
    writes = ops.log[start:]
    copies = [i for i, e in enumerate(writes) if e[0] == "copy"]
    assert len(copies) == len(TILES)
    for i in copies:
        assert writes[i - 1] == ("wait_stream", "side", "compute") and writes[i][3] == "side"
        assert writes[i + 1][:2] == ("record_event", "side")
        assert writes[i + 2] == ("record_stream", writes[i][2], "side")
    assert not [e for e in writes if e[:2] == ("wait_event", "compute")]  # compute never waits for a write
    start = len(ops.log)
    for (lo, hi), ahead in zip(TILES, [*TILES[1:], None]):
        torch.testing.assert_close(stream.read(lo, hi, ahead), x[lo:hi], rtol=0, atol=0)
        ops.log.append(("compute", lo))
    assert_tiles_come_ahead([e for e in ops.log[start:] if e[0] != "free"], len(TILES))
    del stream
    assert off.pool.used == 0 and off.pool.cached == x.numel() * 8  # handed back to the pool


@pytest.mark.parametrize("pool", ["fits", "full"])
def test_streams_through_the_offloader_are_exact_and_the_pool_bound_holds(pool, monkeypatch):
    """Three tiled layers streaming through the offloader's pool: float64-exact gradients; the pool never
    holds more than its bound: a stream that does not fit stays on the device (counted), still exact."""
    from tests.memory.fake_streams import RecordingOps

    one = SEQ * BATCH * HIDDEN * 8
    off = _offloader(RecordingOps(), pool_bytes=one if pool == "fits" else one - 1)
    held = []
    take = off.pool.take

    def counted(nbytes):
        buf = take(nbytes)
        held.append(off.pool.held)
        return buf

    monkeypatch.setattr(off.pool, "take", counted)
    spy = _Spy(monkeypatch)
    run_ref, grads_ref, _ = _model(None, tiles=0)
    ref = grads_ref(run_ref())
    run, grads, _ = _model(residual_offload.Target(offloader=off))
    got = grads(run())
    assert spy.handed == 2
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    assert held and max(held) <= off.pool.capacity
    assert (off.stats.kept_over_bound_bytes == 0) == (pool == "fits")


def test_disk_stream_rows_are_staged_on_the_side_stream_and_the_io_worker(tmp_path):
    """Through a disk offloader: each written tile goes to pinned memory on the side stream (compute never
    waits) and to the file on the I/O worker; reads wait for their rows' writes and come one tile ahead."""
    from megatron_longctx.memory.offload import ActivationOffloader
    from tests.memory.fake_streams import RecordingOps
    from tests.memory.test_offload_rows import TILES, assert_tiles_come_ahead

    ops = RecordingOps(auto_land=False)
    off = ActivationOffloader(MemoryConfig(recompute_granularity="full", recompute_tiles=4, offload_policy="checkpoint",
                                           offload_target="disk", offload_disk_dir=str(tmp_path),
                                           offload_residual_grad=True), ops=ops)
    x = torch.randn(16, 2, 4, dtype=torch.float64)
    stream = residual_offload.Target(off.disk_dir, offloader=off).new(x.shape, x.dtype, x.device)
    for lo, hi in TILES:
        stream.write(lo, hi, x[lo:hi].clone())
    copies = [e for e in ops.log if e[0] == "copy"]
    assert len(copies) == len(TILES) and all(e[3] == "side" for e in copies)
    assert ops.entries("wait_stream") == [("wait_stream", "side", "compute")] * len(TILES)
    assert not [e for e in ops.log if e[:2] == ("wait_event", "compute")]
    assert off.pool.used == 0  # the file holds it
    start = len(ops.log)
    for (lo, hi), ahead in zip(TILES, [*TILES[1:], None]):
        torch.testing.assert_close(stream.read(lo, hi, ahead), x[lo:hi], rtol=0, atol=0)
        ops.log.append(("compute", lo))
    log = [e for e in ops.log[start:] if e[0] != "free"]
    assert ("wait_stream", "side", "compute") not in log
    assert_tiles_come_ahead(log, len(TILES))
    assert off.stats.residual_grad_bytes == 2 * x.numel() * 8
    assert [e for e in ops.log if e[0] == "sync_event"]  # the worker waited for each copy before writing
    off.close()
