"""Checkpoints that lose nothing: an integrity manifest per Megatron iteration folder, checked at load.

Megatron-LM's ``save_checkpoint`` writes each checkpoint into its own folder ``SAVE/iter_NNNNNNN`` and
then points the tracker file ``SAVE/latest_checkpointed_iteration.txt`` at it, so a save that dies
half-way leaves the previous folder and the tracker as they were.  What Megatron does not do is notice
a damaged checkpoint: a ``.distcp`` file with overwritten bytes or cut short loads and trains on NaN.

After every save the main job writes :data:`MANIFEST` into the iteration folder: the size and SHA-256 of
every file in it, written last and atomically, so a folder with a manifest is a complete checkpoint.
Before a run loads, :func:`resolve_load` picks the iteration (the tracker's, or ``--ckpt-step``),
checks every file against the manifest and refuses a mismatch with :class:`CheckpointError` naming the
file.  A tracker that points at a folder without a manifest (killed between Megatron's tracker update
and the manifest) falls back to the newest folder that has one, and says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Optional

MANIFEST = "longctx_manifest.json"
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's get_checkpoint_tracker_filename
_ITER_DIR = re.compile(r"^iter_(\d{7})$")  # Megatron-LM's get_checkpoint_name: iter_{:07d}
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded; the message names the path and what is wrong with it."""


def iteration_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(folder: str) -> list[str]:
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), folder)
            if rel != MANIFEST and not rel.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


def write_manifest(save_dir: str, iteration: int) -> str:
    """Checksum every file of ``save_dir``'s iteration folder into its manifest (atomic); returns its path."""
    folder = iteration_dir(save_dir, iteration)
    files = {rel: {"bytes": os.path.getsize(os.path.join(folder, rel)), "sha256": _sha256(os.path.join(folder, rel))}
             for rel in _files(folder)}
    if not files:
        raise CheckpointError(f"{folder}: Megatron wrote no files for iteration {iteration}")
    path = os.path.join(folder, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump({"iteration": iteration, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return path


def verify(folder: str) -> dict:
    """Check every file of an iteration folder against its manifest; ``CheckpointError`` names the bad file."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{folder} has no {MANIFEST}: its save did not finish (or it was not written by "
                              "megatron-longctx run); refusing to load it")
    with open(path) as f:
        manifest = json.load(f)
    for rel, want in manifest["files"].items():
        file = os.path.join(folder, rel)
        if not os.path.exists(file):
            raise CheckpointError(f"checkpoint file {file} is missing: the checkpoint is incomplete")
        size = os.path.getsize(file)
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint file {file} is {size} bytes, {want['bytes']} were saved: it is "
                                  "truncated or damaged; refusing to load it")
        if _sha256(file) != want["sha256"]:
            raise CheckpointError(f"checkpoint file {file} does not match the checksum written at save time: it "
                                  "is corrupt; refusing to load it")
    return manifest


def saved_iterations(save_dir: str) -> list[int]:
    """Iteration numbers with a folder under ``save_dir``, ascending."""
    if not os.path.isdir(save_dir):
        return []
    return sorted(int(m.group(1)) for m in map(_ITER_DIR.match, os.listdir(save_dir)) if m)


def tracker_iteration(save_dir: str) -> Optional[int]:
    """The iteration Megatron's tracker file points at (``None``: no tracker)."""
    path = os.path.join(save_dir, TRACKER)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number: the main job loads iteration "
                              "checkpoints only")
    return int(text)


def existing_checkpoint(save_dir: str) -> Optional[str]:
    """A description of a checkpoint already in ``save_dir`` (``None`` when there is none)."""
    tracked, folders = tracker_iteration(save_dir) if os.path.isdir(save_dir) else None, saved_iterations(save_dir)
    if tracked is None and not folders:
        return None
    latest = tracked if tracked is not None else folders[-1]
    return f"{save_dir} already holds a checkpoint (iteration {latest}; folders: {len(folders)})"


def resolve_load(load_dir: str, step: Optional[int] = None) -> tuple[int, list[str]]:
    """The verified iteration to load from ``load_dir`` (``step``: a given one) and notes for the user."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir}: no such directory")
    notes: list[str] = []
    if step is not None:
        folder = iteration_dir(load_dir, step)
        if not os.path.isdir(folder):
            raise CheckpointError(f"--ckpt-step {step}: {folder} does not exist (saved: {saved_iterations(load_dir)})")
        verify(folder)
        return step, notes
    tracked = tracker_iteration(load_dir)
    if tracked is None:
        raise CheckpointError(f"--load {load_dir}: no {TRACKER} there, so no complete checkpoint to resume")
    folder = iteration_dir(load_dir, tracked)
    if os.path.exists(os.path.join(folder, MANIFEST)) or not os.path.isdir(folder):
        verify(folder)
        return tracked, notes
    complete = [i for i in saved_iterations(load_dir) if i < tracked
                and os.path.exists(os.path.join(iteration_dir(load_dir, i), MANIFEST))]
    if not complete:
        verify(folder)  # raises: no manifest and nothing older to fall back to
    verify(iteration_dir(load_dir, complete[-1]))
    notes.append(f"{folder} has no {MANIFEST} (its save was interrupted): loading iteration {complete[-1]}, the "
                 "last complete checkpoint")
    return complete[-1], notes


def set_aside_later(save_dir: str, step: int) -> list[str]:
    """Rename the iteration folders after ``step`` (a resume into the same ``--save`` would overwrite them)."""
    import time

    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    notes = []
    for later in (i for i in saved_iterations(save_dir) if i > step):
        folder = iteration_dir(save_dir, later)
        os.replace(folder, f"{folder}.set-aside-{stamp}")
        notes.append(f"resuming from iteration {step}: kept the later {folder} as {folder}.set-aside-{stamp}")
    return notes
