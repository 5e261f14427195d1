"""The off-device AdamW: bit for bit torch's AdamW (float32) with its moments in host memory or in a file,
checkpoints that resume bit for bit, the staging bytes it holds counted against the pool's bound, a
full disk during a step (a real tmpfs) leaving the previous state intact, and a pool too small refused."""

import copy
import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_longctx.memory.host_pool import HostPool
from megatron_longctx.memory.offdevice_optimizer import STATE_FILE, OffDeviceAdamW, OffDeviceSpec
from megatron_longctx.memory.offload_disk import DiskOffloadError
from tests import tmpfs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHUNK = 4096
SHAPES = [(3, 5000), (7001,), (64,), (2, 4096)]  # several chunks, a ragged tail, one small, one exact


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in SHAPES]


def _groups(params):
    """Megatron-like groups: weight decay on / off, per-group lr."""
    return [{"params": params[:2], "lr": 3e-3, "weight_decay": 0.1},
            {"params": params[2:], "lr": 1e-3, "weight_decay": 0.0}]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    params[-1].grad = None if step == 1 else params[-1].grad  # a step in which one parameter has no grad


def _ours(params, target, tmp_path, pool=None):
    pool = pool or HostPool(1 << 20, pin=False)
    spec = OffDeviceSpec(target, pool, str(tmp_path) if target == "disk" else None, chunk_numel=CHUNK)
    return OffDeviceAdamW(_groups(params), spec, betas=(0.9, 0.95), eps=1e-8)


def _run(opt, params, steps, first=0):
    for step in range(first, first + steps):
        _grads(params, step)
        opt.step()


@pytest.mark.parametrize("target", ["host", "disk"])
def test_equals_torch_adamw_bit_for_bit(target, tmp_path):
    ref_params, params = _params(), _params()
    ref = torch.optim.AdamW(_groups(ref_params), betas=(0.9, 0.95), eps=1e-8, foreach=False)
    opt = _ours(params, target, tmp_path)
    _run(ref, ref_params, 4)
    _run(opt, params, 4)
    for a, b, start in zip(params, ref_params, _params()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert not torch.equal(a, start)  # every parameter moved
    ours, theirs = opt.state_dict(), ref.state_dict()
    assert ours["state"].keys() == theirs["state"].keys()
    for i, state in theirs["state"].items():
        for key, t in state.items():
            torch.testing.assert_close(ours["state"][i][key], t, rtol=0, atol=0)
    opt.close()


@pytest.mark.parametrize("target", ["host", "disk"])
def test_state_dict_resumes_bit_for_bit_and_loads_into_torch(target, tmp_path):
    straight = _params()
    opt = _ours(straight, target, tmp_path / "a")
    _run(opt, straight, 4)

    first = _params()
    half = _ours(first, target, tmp_path / "b")
    _run(half, first, 2)
    saved = half.state_dict()
    resumed_params = [p.detach().clone().requires_grad_() for p in first]
    resumed = _ours(resumed_params, target, tmp_path / "c")
    resumed.load_state_dict(copy.deepcopy(saved))  # a load aliases same-device tensors
    _run(resumed, resumed_params, 2, first=2)
    for a, b in zip(resumed_params, straight):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    torch_params = [p.detach().clone().requires_grad_() for p in first]
    plain = torch.optim.AdamW(_groups(torch_params), betas=(0.9, 0.95), foreach=False)
    plain.load_state_dict(copy.deepcopy(saved))
    _run(plain, torch_params, 2, first=2)
    for a, b in zip(torch_params, straight):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for o in (opt, half, resumed):
        o.close()


@pytest.mark.parametrize("target", ["host", "disk"])
def test_staging_bytes_never_exceed_the_pool_bound(target, tmp_path):
    pool = HostPool(3 * CHUNK * 4 + 1000, pin=False)
    held = []
    take = pool.take

    def counting_take(nbytes):
        buf = take(nbytes)
        held.append(pool.held)
        return buf

    pool.take = counting_take
    params = _params()
    opt = _ours(params, target, tmp_path, pool)
    _run(opt, params, 2)
    buffers = 3 if target == "disk" else 1
    assert held and max(held) <= pool.capacity
    assert opt.staging_peak == buffers * CHUNK * 4  # one chunk's buffers, whatever the parameter count
    assert pool.used == 0  # all given back
    opt.close()


def test_pool_too_small_for_one_chunk_is_refused_with_the_bytes(tmp_path):
    pool = HostPool(3 * CHUNK * 4 - 1, pin=False)
    with pytest.raises(ValueError) as info:
        _ours(_params(), "disk", tmp_path, pool)
    msg = str(info.value)
    assert str(3 * CHUNK * 4) in msg and "--longctx-offload-host-pool-bytes" in msg, msg
    assert os.listdir(tmp_path) == []  # refused before any file


def test_full_disk_during_a_step_leaves_the_previous_state(tmp_path):
    params = _params()
    file_bytes = 2 * 4 * sum(p.numel() for p in params)
    # room for one moments file (plus the lock) but not for the next step's temporary copy beside it
    with tmpfs.mounted(tmp_path / "small", f"size={file_bytes + 64 * 1024}") as small:
        opt = _ours(params, "disk", small)
        _run(opt, params, 1)
        after_one = [p.detach().clone() for p in params]
        state_one = opt.state_dict()
        with open(opt.path, "rb") as fh:
            on_disk = fh.read()
        _grads(params, 1)
        with pytest.raises(DiskOffloadError) as info:
            opt.step()
        msg = str(info.value)
        assert info.value.errno == errno.ENOSPC
        assert "--longctx-offload-disk-dir" in msg and str(small) in msg and str(file_bytes) in msg, msg
        for a, b in zip(params, after_one):  # nothing applied
            torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
        with open(opt.path, "rb") as fh:
            assert fh.read() == on_disk  # the previous file intact
        assert not os.path.exists(opt.path + ".tmp")
        state_now = opt.state_dict()
        for i, state in state_one["state"].items():
            for key, t in state.items():
                torch.testing.assert_close(state_now["state"][i][key], t, rtol=0, atol=0)
        assert os.path.basename(opt.path) == STATE_FILE
        opt.close()


def test_file_size_limit_during_a_step_leaves_the_previous_state_in_a_child(tmp_path):
    """Without root (no tmpfs): RLIMIT_FSIZE below one moments file makes the step's write fail with EFBIG."""
    code = textwrap.dedent(f"""
        import resource, signal, sys, torch
        sys.path.insert(0, {ROOT!r})
        from tests.memory.test_offdevice_optimizer import _grads, _ours, _params, _run
        from megatron_longctx.memory.offload_disk import DiskOffloadError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG
        params = _params()
        opt = _ours(params, "disk", {str(tmp_path)!r})
        _run(opt, params, 1)
        after_one = [p.detach().clone() for p in params]
        on_disk = open(opt.path, "rb").read()
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(on_disk) // 2, resource.RLIM_INFINITY))
        _grads(params, 1)
        try:
            opt.step()
        except DiskOffloadError as exc:
            print("ERROR", exc.errno, exc)
        print("PARAMS", all(torch.equal(a, b) for a, b in zip(params, after_one)))
        print("FILE", open(opt.path, "rb").read() == on_disk, len(on_disk))
        opt.close()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    out = proc.stdout
    file_bytes = 2 * 4 * sum(p.numel() for p in _params())
    assert f"ERROR {errno.EFBIG}" in out, out + proc.stderr
    assert "--longctx-offload-disk-dir" in out and str(tmp_path) in out and str(file_bytes) in out, out
    assert "PARAMS True" in out and f"FILE True {file_bytes}" in out, out
    assert os.listdir(tmp_path) == []  # the run directory removed on close
