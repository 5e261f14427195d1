"""A small filesystem that really fills: a tmpfs mounted for one test (root only; the test is skipped otherwise)."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def mounted(path, options: str, otherwise: str = ""):
    """``path`` with a tmpfs of mount ``options`` (e.g. ``size=192k``) on it, unmounted after; ``otherwise``:
    what covers the fault where the mount is refused (said in the skip reason)."""
    os.makedirs(path, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)" + (f": {otherwise}" if otherwise else ""))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
