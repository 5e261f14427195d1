"""Megatron-LM's unmodified training scripts as test fixtures: find them, copy them, run them.

Finding, copying and running them is :mod:`megatron_longctx.megatron.lm_scripts` (``$MEGATRON_LM_DIR``,
then ``../shared/megatron-lm/<ref>`` beside the project root).  :func:`require_scripts` skips the test
with that reason when neither exists, and :func:`require_training` when the installed megatron-core has no
``megatron.training`` (the 0.16.1 wheel has none).  :func:`copy_scripts` copies them into a test's
temporary folder (which has no ``megatron/`` folder, so the installed megatron-core is what gets
imported), and :func:`run_script` runs one through ``torchrun`` and :mod:`megatron_longctx.launch`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import pytest

from megatron_longctx.megatron import lm_scripts
from megatron_longctx.megatron.lm_scripts import (  # noqa: F401 - re-exported for the tests
    LAUNCHER,
    REF_016,
    REF_019,
    SCRIPT_FILES,
    ScriptRun,
    scripts_dir,
)

REPO = lm_scripts.PROJECT_ROOT
TIMEOUT_S = int(os.environ.get("LONGCTX_TEST_TIMEOUT", "600"))

# The smallest GPT that exercises every layer type: 2 layers, hidden 64, 4 heads, 256 tokens.
# No dropout (each CP rank would draw its own masks), no evaluation (it only costs time).
TINY_GPT = (
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "256", "--max-position-embeddings", "256",
    "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
    "--seed", "1234",
)


def require_scripts(ref: str = REF_019) -> Path:
    folder = scripts_dir(ref)
    if folder is None:
        pytest.skip(lm_scripts.missing_scripts_message(ref))
    return folder


def has_training() -> bool:
    try:
        import megatron.training.arguments  # noqa: F401
    except ImportError:
        return False
    return True


def require_training() -> None:
    if not has_training():
        pytest.skip("this megatron-core has no megatron.training (the 0.16.1 wheel ships none), which "
                    "Megatron-LM's scripts need")


def copy_scripts(dst: Path, ref: str = REF_019) -> Path:
    """Copy the scripts of ``ref`` into ``dst`` (created); return ``dst / 'pretrain_gpt.py'`` (skip if absent)."""
    require_scripts(ref)
    return lm_scripts.copy_scripts(dst, ref)


def run_script(script: Path, args: Sequence[str], nproc: int = 2, launcher: Sequence[str] = LAUNCHER,
               env: Optional[dict] = None, timeout: int = TIMEOUT_S) -> ScriptRun:
    """:func:`megatron_longctx.megatron.lm_scripts.run_script`; ``TimeoutExpired`` past ``timeout``."""
    run = lm_scripts.run_script(script, args, nproc, launcher, env, timeout)
    if run.timed_out:
        raise subprocess.TimeoutExpired([str(script), *args], timeout, run.output)
    return run


def assert_same_losses(actual: Sequence[float], expected: Sequence[float], rtol: float = 1e-5) -> None:
    """Same number of iterations and each loss within ``rtol`` (relative)."""
    import torch

    assert len(actual) == len(expected) and len(expected) > 0, (actual, expected)
    torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64),
                               rtol=rtol, atol=0.0)
