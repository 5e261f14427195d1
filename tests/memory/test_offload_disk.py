"""Disk offload files: where they live, removed on exit / SIGTERM / SIGINT / at the next start after a
SIGKILL, and a full disk or unwritable directory is an error naming the flag, the path and the errno.

Faults are real: a tiny tmpfs filled up (root), RLIMIT_FSIZE in a child, a read-only mount, children
killed with SIGKILL / SIGTERM / SIGINT.
"""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from megatron_longctx.memory import MemoryConfig, hooks
from megatron_longctx.memory import offload_disk
from megatron_longctx.memory.offload import ActivationOffloader
from megatron_longctx.memory.offload_disk import DiskOffloadError
from tests import tmpfs

FALLBACK = "the RLIMIT_FSIZE test injects the write failure instead"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(path=None):
    return MemoryConfig(offload_policy="layers", offload_target="disk", offload_min_bytes=0,
                        offload_disk_dir=None if path is None else str(path))


def _offload(off, kib=256, layers=2):
    x = torch.randn(kib * 128, dtype=torch.float64, requires_grad=True)  # kib KiB
    with hooks.packing(off):
        for i in range(layers):
            with hooks.layer_scope(i):
                x = torch.tanh(x)
    off.synchronize()
    return x


def test_full_disk_names_flag_path_and_enospc(tmp_path):
    with tmpfs.mounted(tmp_path / "small", "size=192k", FALLBACK) as small:
        off = ActivationOffloader(_cfg(small))
        with pytest.raises(DiskOffloadError) as info:
            _offload(off, kib=128, layers=3)
        msg = str(info.value)
        assert info.value.errno == errno.ENOSPC
        assert "--longctx-offload-disk-dir" in msg and "ENOSPC" in msg and str(small) in msg, msg
        off.close()
        assert os.listdir(small) == []


def test_file_size_limit_names_the_flag_in_a_child(tmp_path):
    code = textwrap.dedent(f"""
        import resource, signal, sys, torch
        sys.path.insert(0, {ROOT!r})
        from tests.memory.test_offload_disk import _cfg, _offload
        from megatron_longctx.memory.offload import ActivationOffloader
        from megatron_longctx.memory.offload_disk import DiskOffloadError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG
        off = ActivationOffloader(_cfg({str(tmp_path)!r}))
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        try:
            _offload(off, kib=128)
        except DiskOffloadError as exc:
            print("ERROR", exc.errno, exc)
        off.close()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert f"ERROR {errno.EFBIG}" in proc.stdout, proc.stdout + proc.stderr
    assert "--longctx-offload-disk-dir" in proc.stdout and "EFBIG" in proc.stdout
    assert os.listdir(tmp_path) == []


def test_unwritable_directory_fails_at_construction(tmp_path):
    with tmpfs.mounted(tmp_path / "ro", "ro,size=64k", FALLBACK) as ro:
        with pytest.raises(DiskOffloadError) as info:
            ActivationOffloader(_cfg(ro))
        assert info.value.errno == errno.EROFS
        assert "--longctx-offload-disk-dir" in str(info.value) and str(ro) in str(info.value)


def test_default_directory_under_the_run_output_or_a_named_temp_dir(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    off = ActivationOffloader(_cfg())
    assert os.path.dirname(off.disk_dir) == str(tmp_path / "tmp" / f"longctx-offload-{offload_disk._user()}")
    off.close()
    global_vars = pytest.importorskip("megatron.training.global_vars")
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", type("Args", (), {"save": str(tmp_path / "run")})())
    off = ActivationOffloader(_cfg())
    assert os.path.dirname(off.disk_dir) == str(tmp_path / "run" / "offload")
    out = _offload(off)
    assert len(os.listdir(off.disk_dir)) > 1  # the lock and offloaded tensors
    out.sum().backward()
    off.close()
    assert os.listdir(tmp_path / "run" / "offload") == []


_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from tests.memory.test_offload_disk import _cfg, _offload
    from megatron_longctx.memory.offload import ActivationOffloader
    off = ActivationOffloader(_cfg({path!r}))
    keep = _offload(off)
    print(off.disk_dir, flush=True)
    sys.stdin.readline()  # a line: exit normally, without close(); or wait here for a signal
""")


def _child(path):
    proc = subprocess.Popen([sys.executable, "-c", _CHILD.format(root=ROOT, path=str(path))], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = proc.stdout.readline().strip()
    assert run_dir and os.path.isdir(run_dir), proc.stderr.read() if proc.poll() is not None else run_dir
    assert len(os.listdir(run_dir)) > 1  # files written
    return proc, run_dir


def test_sigkilled_run_leaves_files_the_next_start_removes(tmp_path):
    killed, killed_dir = _child(tmp_path)
    alive, alive_dir = _child(tmp_path)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert os.path.isdir(killed_dir)  # nothing could clean up after SIGKILL
        off = ActivationOffloader(_cfg(tmp_path))  # the next start
        assert off._run_dir.stale_removed == [killed_dir]
        assert not os.path.exists(killed_dir)
        assert os.path.isdir(alive_dir)  # a live run's directory is left alone
        off.close()
    finally:
        alive.kill()
        alive.wait(30)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, None])
def test_sigterm_sigint_and_exit_remove_the_run_directory(tmp_path, sig):
    proc, run_dir = _child(tmp_path)
    if sig is None:  # a normal exit that never called close()
        proc.stdin.write("\n")
        proc.stdin.flush()
    else:
        proc.send_signal(sig)
    rc = proc.wait(60)
    assert (rc == 0) if sig is None else (rc != 0), proc.stderr.read()
    deadline = time.monotonic() + 10
    while os.path.exists(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(run_dir), os.listdir(run_dir)
    assert os.listdir(tmp_path) == []
