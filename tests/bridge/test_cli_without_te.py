"""``python -m megatron_longctx.bridge`` in a fresh interpreter (no stand-in for Transformer Engine): ``--help``
answers, and a recipe run without Transformer Engine (or without Bridge) is refused in one line."""

import importlib.util
import subprocess
import sys

from tests.job.main_job import env


def _bridge(*argv):
    return subprocess.run([sys.executable, "-m", "megatron_longctx.bridge", *argv], env=env(), capture_output=True,
                          text=True, timeout=300)


def test_help_answers_without_importing_bridge():
    proc = _bridge("--help")
    assert proc.returncode == 0 and "--recipe PKG.MOD:FN" in proc.stdout and "--longctx-" in proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_recipe_run_without_transformer_engine_is_refused_in_one_line():
    if importlib.util.find_spec("transformer_engine") is not None:
        import pytest

        pytest.skip("Transformer Engine is installed here")
    proc = _bridge("--recipe", "megatron.bridge.recipes.gpt.vanilla_gpt:vanilla_gpt_pretrain_config", "--dry-run")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    has_bridge = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.bridge")
    named = "Transformer Engine (transformer_engine.pytorch)" if has_bridge else "Megatron-Bridge is not installed"
    assert named in lines[0] and "python -m megatron_longctx.launch" in lines[0], lines[0]
