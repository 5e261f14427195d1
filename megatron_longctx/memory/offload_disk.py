"""Where disk-offloaded activations live, and their file I/O with errors that name the flag.

Each offloader writes into its own *run directory* ``run-<host>-<pid>-<random>`` under a root:
``--longctx-offload-disk-dir`` when given, else ``<run output directory>/offload`` (the config's
``offload_run_dir`` when set, else Megatron's ``--save`` directory once Megatron's arguments are
parsed), else ``<tmp>/longctx-offload-<user>``.  The run directory holds an exclusive ``flock`` on
its ``.lock`` file for the life of the process; the kernel drops it when the process dies, however it
dies (SIGKILL included), so the next start under the same root removes every run directory whose lock
it can take.  A run directory is removed on :meth:`RunDir.remove`, at interpreter exit, and on
SIGTERM / SIGINT (the previous handler is then called as before).

A full disk, a file-size limit, or an unwritable directory raises :class:`DiskOffloadError` naming
the flag, the path and the errno (``ENOSPC`` ...), instead of numpy's "N requested and 0 written".
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import getpass
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Optional

import numpy as np
import torch

FLAG = "--longctx-offload-disk-dir"
LOCK = ".lock"
_PREFIX = "run-"
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}


class DiskOffloadError(OSError):
    """Disk offload could not write or read its files (the message names the flag, path and errno)."""


def disk_error(what: str, path: str, exc: OSError) -> DiskOffloadError:
    code = errno.errorcode.get(exc.errno or 0, "EIO")
    if exc.errno in _FULL:
        hint = (f"the disk is full or the file-size limit is reached: free space under {os.path.dirname(path)}, "
                f"point {FLAG} at a larger disk, or use --longctx-offload-target host")
    elif exc.errno in _DENIED:
        hint = f"the directory is not writable: give {FLAG} a directory this user can write"
    else:
        hint = f"check the disk behind {FLAG}"
    return DiskOffloadError(exc.errno or errno.EIO, f"{FLAG}: {what} {path} failed: {code} ({exc.strerror}); {hint}")


def default_root(cfg: Any) -> str:
    """The directory the run directories go under (see the module docstring)."""
    if getattr(cfg, "offload_disk_dir", None):
        return cfg.offload_disk_dir
    run_dir = getattr(cfg, "offload_run_dir", None) or _megatron_save_dir()
    if run_dir:
        return os.path.join(run_dir, "offload")
    return os.path.join(tempfile.gettempdir(), f"longctx-offload-{_user()}")


def _megatron_save_dir() -> Optional[str]:
    global_vars = sys.modules.get("megatron.training.global_vars")  # only if Megatron's training is in use
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    return getattr(args, "save", None) or None


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (containers): the uid will do
        return str(os.getuid())


def remove_stale(root: str, grace_s: float = 60.0) -> list[str]:
    """Remove the run directories under ``root`` whose process is gone; returns their paths."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if not os.path.isdir(path):
                continue
            if name.startswith("." + _PREFIX):  # killed while being set up (before its lock was held)
                with contextlib.suppress(FileNotFoundError):
                    if time.time() - os.path.getmtime(path) > grace_s:
                        shutil.rmtree(path, ignore_errors=True)
                        removed.append(path)
                continue
            if not name.startswith(_PREFIX):
                continue
            if _is_stale(path, grace_s):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _is_stale(path: str, grace_s: float) -> bool:
    lock = os.path.join(path, LOCK)
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:  # killed between creating the directory and its lock, or being created now
        with contextlib.suppress(FileNotFoundError):
            return time.time() - os.path.getmtime(path) > grace_s
        return False
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live process holds it
    finally:
        os.close(fd)  # also drops the lock we may have taken
    return True


class RunDir:
    """This process's offload directory under ``root``: locked while alive, removed on exit and signals."""

    def __init__(self, root: str) -> None:
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as exc:
            raise disk_error("creating the offload directory", root, exc) from exc
        self.stale_removed = remove_stale(root)
        try:
            # made under a hidden name and renamed once locked: another process's remove_stale never sees
            # a directory whose lock is not held yet
            name = f"{_PREFIX}{socket.gethostname()}-{os.getpid()}-"
            hidden = tempfile.mkdtemp(prefix="." + name, dir=root)
            self._fd = os.open(os.path.join(hidden, LOCK), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(self._fd, f"{os.getpid()}\n".encode())
            self.path = os.path.join(root, os.path.basename(hidden)[1:])
            os.rename(hidden, self.path)
        except OSError as exc:
            raise disk_error("creating a run directory under", root, exc) from exc
        probe = os.path.join(self.path, "probe.bin")
        write_file(torch.zeros(4096, dtype=torch.uint8), probe)  # fails now, not in the first backward
        os.remove(probe)
        _register(self)

    def remove(self) -> None:
        _LIVE.discard(self)
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


# ------------------------------------------------------------------ cleanup at exit and on signals
_LIVE: set = set()
_HANDLED: dict = {}
_REG_LOCK = threading.Lock()


def _remove_all() -> None:
    for run_dir in list(_LIVE):
        run_dir.remove()


def _register(run_dir: RunDir) -> None:
    with _REG_LOCK:
        _LIVE.add(run_dir)
        if _HANDLED:
            return
        atexit.register(_remove_all)
        _HANDLED["atexit"] = True
        if threading.current_thread() is not threading.main_thread():
            warnings.warn("disk offload set up outside the main thread: its files are removed at exit, "
                          "not on SIGTERM/SIGINT (the next start removes them)", RuntimeWarning, stacklevel=3)
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous = signal.getsignal(sig)
            signal.signal(sig, _make_handler(previous))
            _HANDLED[sig] = previous


def _make_handler(previous: Any):
    def handler(signum: int, frame: Any) -> Any:
        _remove_all()
        if callable(previous):
            return previous(signum, frame)
        if previous == signal.SIG_IGN:
            return None
        signal.signal(signum, signal.SIG_DFL)  # the default action, with the right exit status
        os.kill(os.getpid(), signum)
        return None

    return handler


# ------------------------------------------------------------------ file I/O (runs on the I/O worker)
def write_file(data: torch.Tensor, path: str) -> None:
    """Write ``data`` (host ``[n]`` uint8) to ``path``; a failure raises :class:`DiskOffloadError`."""
    view = memoryview(data.numpy()).cast("B")
    try:
        with open(path, "wb", buffering=0) as fh:
            done = 0
            while done < len(view):
                done += fh.write(view[done:])
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise disk_error(f"writing {len(view)} bytes to", path, exc) from exc


def read_file(path: str, nbytes: int, offset: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``[nbytes]`` uint8 written to ``path`` from byte ``offset`` on; into ``out`` (host ``[nbytes]``
    uint8, e.g. pinned memory) when given."""
    try:
        if out is None:
            data = np.fromfile(path, dtype=np.uint8, count=nbytes, offset=offset)
            got = data.size
        else:
            data = out.numpy()
            fd = os.open(path, os.O_RDONLY)
            try:
                got = os.preadv(fd, [memoryview(data)], offset)
            finally:
                os.close(fd)
    except OSError as exc:
        raise disk_error(f"reading {nbytes} bytes from", path, exc) from exc
    if got != nbytes:
        raise DiskOffloadError(errno.EIO, f"{FLAG}: {path} holds {got} of {nbytes} bytes from byte {offset} "
                                          "(truncated or removed while training; another process may share the "
                                          "directory)")
    return torch.from_numpy(data) if out is None else out


def remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
