"""The launcher's install step: idempotent, version-checked, reversible; flags and spec reach Megatron."""

import json
import os
import subprocess
import sys

import pytest

from megatron_longctx.config import ContextParallelConfig, LongContextConfig
from megatron_longctx.megatron import launch
from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import WORLD

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _clean():
    launch.uninstall()
    yield
    launch.uninstall()


def _has_training() -> bool:
    try:
        import megatron.training.arguments  # noqa: F401
    except ImportError:
        return False
    return True


def test_install_is_idempotent_and_reversible():
    from megatron.core.models.gpt.gpt_model import GPTModel

    original_init = GPTModel.__init__
    launch.install()
    wrapped = GPTModel.__init__
    assert wrapped is not original_init and launch.is_installed()
    launch.install()
    assert GPTModel.__init__ is wrapped, "a second install must not wrap twice"
    launch.uninstall()
    assert GPTModel.__init__ is original_init and not launch.is_installed()
    launch.uninstall()  # no-op


def test_unknown_megatron_version_is_refused(monkeypatch):
    monkeypatch.setattr(launch, "megatron_version", lambda: (0, 99))
    monkeypatch.delenv(launch.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"supports Megatron-Core 0\.16.*found 0\.99"):
        launch.install()
    assert not launch.is_installed()
    monkeypatch.setenv(launch.ALLOW_UNTESTED_ENV, "1")
    launch.install()
    assert launch.is_installed()


def test_flags_appear_in_megatrons_parser(monkeypatch):
    if not _has_training():
        pytest.skip("this Megatron-Core wheel does not ship megatron.training (0.19 does)")
    from megatron.training import arguments

    launch.install()
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--context-parallel-size", "2", "--attention-dropout", "0",
                                     "--longctx-cp-algorithm", "ring", "--longctx-tiled-mlp-tiles", "2"])
    args = arguments.parse_args()
    assert args.context_parallel_size == 2
    assert args.longctx_cp_algorithm == "ring" and args.longctx_tiled_mlp_tiles == 2
    from megatron_longctx import add_longctx_args

    args = arguments.parse_args(extra_args_provider=add_longctx_args)  # a script that also passes ours
    assert args.longctx_cp_algorithm == "ring"
    launch.uninstall()
    with pytest.raises(SystemExit):
        arguments.parse_args()  # our flags are gone again


def _model_hook():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.megatron.core_attention import ContextParallelAttention
    from tests.gpt_kit import build_gpt, local_spec, tiny_config

    with cpu_compat.enabled(), megatron_parallel(cp=2):
        launch.install(LongContextConfig(cp=ContextParallelConfig(cp_algorithm="allgather")))
        try:
            model = build_gpt(tiny_config(1, 2), local_spec())
            attns = [layer.self_attention.core_attention for layer in model.decoder.layers]
            assert all(isinstance(a, ContextParallelAttention) for a in attns)
            assert {a.settings.algorithm for a in attns} == {"allgather"}
            if _has_training():  # options parsed by Megatron's parser (launcher path without a fixed config)
                from megatron.training import arguments, global_vars

                launch.install(None)
                parser = arguments.add_megatron_arguments(__import__("argparse").ArgumentParser())
                args = parser.parse_args(["--longctx-cp-algorithm", "ulysses"])
                global_vars.set_args(args)
                try:
                    model = build_gpt(tiny_config(1, 2), local_spec())
                    assert model.decoder.layers[0].self_attention.core_attention.settings.algorithm == "ulysses"
                finally:
                    global_vars.set_args(None)
            from megatron_longctx.memory import MemoryConfig

            launch.install(LongContextConfig(memory=MemoryConfig(recompute_granularity="full", tiled_mlp_tiles=2)))
            model = build_gpt(tiny_config(1, 2), local_spec())
            assert getattr(model, "_longctx_memory_handle", None) is not None  # memory.install ran on the model
            assert type(model.decoder.layers[0].mlp).__name__ == "TiledMLP"  # spec-level memory option applied
        finally:
            launch.uninstall()
        with megatron_parallel_reset():
            model = build_gpt(tiny_config(), local_spec())
            assert isinstance(model.decoder.layers[0].self_attention.core_attention, DotProductAttention)


class megatron_parallel_reset:
    """Re-initialise parallel_state with CP=1 for the uninstalled build (DotProductAttention needs CP=1)."""

    def __enter__(self):
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel()

    def __exit__(self, *exc):
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(context_parallel_size=2)


def test_installed_model_classes_transform_their_spec():
    run_ranks(WORLD, _model_hook)


SCRIPT = """
import json, sys
from megatron_longctx.megatron import launch
out = {"installed": launch.is_installed(), "argv": sys.argv[1:], "main": __name__}
try:
    from megatron.training import arguments
except ImportError:
    arguments = None
if arguments is not None:
    args = arguments.parse_args(ignore_unknown_args=True)
    out["cp_algorithm"] = args.longctx_cp_algorithm
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
"""


def test_launcher_runs_an_unmodified_script(tmp_path):
    script = tmp_path / "pretrain_stub.py"
    script.write_text(SCRIPT)
    result = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_longctx.launch", str(script), str(result), "--longctx-cp-algorithm", "ring"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(result.read_text())
    assert out["installed"] is True and out["main"] == "__main__"
    assert out["argv"][:3] == [str(result), "--longctx-cp-algorithm", "ring"]  # then the defaults it set
    if _has_training():
        assert out["cp_algorithm"] == "ring"
        from megatron_longctx.megatron import cpu_compat

        if cpu_compat.needed():
            assert "--distributed-backend" in out["argv"][3:] and "gloo" in out["argv"][3:]
            assert "defaults set (explicit flags win): --distributed-backend gloo" in proc.stdout


def test_launcher_usage_errors(tmp_path):
    with pytest.raises(SystemExit, match="no such script"):
        launch.main([str(tmp_path / "missing.py")])


def test_patch_imports_exist():
    """Every name the patches/ diffs import from megatron_longctx exists."""
    import glob
    import re

    diffs = sorted(glob.glob(os.path.join(REPO, "patches", "*.diff")))
    assert len(diffs) == 2
    for path in diffs:
        added = [line[1:] for line in open(path).read().splitlines() if line.startswith("+") and not line.startswith("+++")]
        imports = [line for line in added if re.match(r"\s*from megatron_longctx", line)]
        assert imports, path
        for line in imports:
            exec(line.strip(), {})


def test_script_hooks():
    import argparse

    from megatron_longctx.megatron.script_hooks import extra_args_provider, longctx_layer_spec
    from megatron_longctx.megatron.spec import count_context_parallel_attention
    from tests.gpt_kit import local_spec

    def other(parser):
        parser.add_argument("--other-flag", type=int, default=1)
        return parser

    args = extra_args_provider(other)(argparse.ArgumentParser()).parse_args(["--other-flag", "3",
                                                                            "--longctx-cp-algorithm", "ring"])
    assert args.other_flag == 3 and args.longctx_cp_algorithm == "ring"
    cfg = LongContextConfig(cp=ContextParallelConfig(cp_algorithm="allgather"))
    for base in (local_spec(), lambda model_config: local_spec(), lambda model_config, vp_stage=None: local_spec()):
        spec = longctx_layer_spec(base, cfg)(object(), vp_stage=None)
        assert count_context_parallel_attention(spec) == 1
        assert spec.submodules.self_attention.submodules.core_attention.params["cp_config"].cp_algorithm == "allgather"


def test_patch_019_layer_spec_with_megatrons_default():
    """The 0.19 diff's ``longctx_layer_spec(None, ...)`` wraps Megatron's own ``default_layer_spec``."""
    try:
        from megatron.training.models.gpt import GPTModelConfig
    except ImportError:
        pytest.skip("megatron.training.models.gpt (the 0.19 model config) is not in this Megatron-Core")
    from megatron_longctx.megatron.script_hooks import longctx_layer_spec
    from megatron_longctx.megatron.spec import count_context_parallel_attention
    from tests.gpt_kit import tiny_config

    model_cfg = GPTModelConfig(transformer=tiny_config(transformer_impl="local"), vocab_size=64)
    cfg = LongContextConfig(cp=ContextParallelConfig(cp_algorithm="ring"))
    model_cfg.transformer_layer_spec = longctx_layer_spec(model_cfg.transformer_layer_spec, cfg)
    spec = model_cfg.transformer_layer_spec(model_cfg, vp_stage=None)
    assert count_context_parallel_attention(spec) == 1


def test_default_args_explicit_flags_win():
    if not _has_training():
        pytest.skip("this Megatron-Core wheel does not ship megatron.training (0.19 does)")
    from megatron_longctx.megatron import cpu_compat

    argv, added = launch.default_args(["--num-layers", "2", "--distributed-backend=nccl", "--context-parallel-size",
                                       "2", "--attention-dropout", "0.1"])
    assert argv[:6] == ["--num-layers", "2", "--distributed-backend=nccl", "--context-parallel-size", "2",
                        "--attention-dropout"]
    assert "--no-create-attention-mask-in-dataloader" in added  # the dense mask is off
    assert not any(a.startswith(("--distributed-backend", "--attention-dropout")) for a in added)
    if cpu_compat.needed():
        assert "--no-gradient-accumulation-fusion" in added and "--no-persist-layer-norm" in added
    _, added = launch.default_args(["--num-layers", "2"])  # CP = 1: no CP defaults, and still no dense mask
    assert "--no-create-attention-mask-in-dataloader" in added and "--attention-dropout 0" not in added


def test_after_parsing_checks_name_the_flag():
    import argparse

    from megatron_longctx.megatron.arguments import add_longctx_args, check_after_parsing

    parser = add_longctx_args(argparse.ArgumentParser())
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    check_after_parsing(parser.parse_args([]))  # CP = 1: dropout is fine
    for argv, flag in ((["--context-parallel-size", "2"], "--attention-dropout"),
                       (["--longctx-cp-kernel-backend", "nope"], "--longctx-cp-kernel-backend"),
                       (["--longctx-cp-ulysses-size", "-2"], "--longctx-cp-ulysses-size")):
        with pytest.raises(ValueError, match=f"^{flag}: "):
            check_after_parsing(parser.parse_args(argv))


def test_help_percent_is_escaped():
    import argparse

    from megatron_longctx.megatron.arguments import escape_help_percents

    parser = argparse.ArgumentParser()
    parser.add_argument("--factor", default=2, help="100% of the buffer, default %(default)s")
    with pytest.raises((ValueError, TypeError)):
        parser.format_help()
    assert "100% of the buffer, default 2" in " ".join(escape_help_percents(parser).format_help().split())


def test_launcher_help_lists_the_group(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "megatron_longctx.launch", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--longctx-cp-algorithm" in proc.stdout and "--longctx-tiled-loss-tiles" in proc.stdout
    if _has_training():
        assert "--context-parallel-size" in proc.stdout  # Megatron's own arguments, help formatted


def test_mixed_megatron_trees_warn(tmp_path, monkeypatch, capsys):
    import importlib

    import megatron.core  # noqa: F401 - the installed tree

    (tmp_path / "megatron" / "longctx_probe").mkdir(parents=True)
    (tmp_path / "megatron" / "longctx_probe" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("megatron.longctx_probe")  # a second tree joins the namespace package
        trees = launch.megatron_trees()
        assert str(tmp_path) in trees and len(trees) == 2
        launch.warn_if_mixed_trees()
        assert "Megatron is loaded from 2 trees" in capsys.readouterr().err
    finally:
        sys.modules.pop("megatron.longctx_probe", None)
