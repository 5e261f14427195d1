"""One build path: the spec transform and every feature's install are called only by the plugin object
(``megatron/plugin.py``) and the installers themselves (``megatron/features/``); the launcher's and the
main job's replaced attributes go through ``patching`` so ``patching.active()`` tells the truth."""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_longctx"
# What edits a spec or puts a feature on a built model; a call of one of these is a build path.
SPEC_TRANSFORM = {"self_attention_rule", "tile_spec", "tiled_mlp_spec"}
FEATURE_INSTALL = {"tile_mlp_forward", "install_tiled_loss", "install_lean_norms", "apply_selective_recompute",
                   "wrap_layer", "release_embedding_output", "ActivationOffloader", "offloader_of",
                   "residual_grad_target", "tiled_checkpoint", "_scope_module", "_refuse_intermediate_outputs"}
# The installer objects: only the plugin object imports them (config.FEATURES is another thing: the config
# sections).
FEATURES_PACKAGE = "megatron_longctx.megatron.features"
INSTALLERS = {"FEATURES", "TiledMLPFeature", "TiledLossFeature", "LeanNormFeature", "RecomputeFeature",
              "OffloadFeature", "ModelStatesFeature", "_optimizer_hooks", "_close"}


def _allowed(path: pathlib.Path, root: pathlib.Path) -> bool:
    rel = path.relative_to(root).as_posix()
    return rel == "megatron/plugin.py" or rel.startswith("megatron/features/")


def _defined_in(tree: ast.AST) -> set:
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def build_paths(root: pathlib.Path = PACKAGE) -> list:
    """``"file:line name"`` for every call of a spec transform or feature install, and every use of an
    installer, outside the plugin object and its installers (a call inside the function's own module is
    its definition's business)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if _allowed(path, root):
            continue
        tree = ast.parse(path.read_text(), str(path))
        own = _defined_in(tree)
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name not in SPEC_TRANSFORM | FEATURE_INSTALL or name in own:
                    name = None
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(FEATURES_PACKAGE):
                name = next((a.name for a in node.names if a.name in INSTALLERS), None)
            if name is not None:
                found.append(f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')} {name}")
    return found


def test_only_the_plugin_object_builds():
    assert build_paths() == [], "a second build path outside megatron/plugin.py"


def test_the_scan_finds_a_second_caller(tmp_path):
    """The scan is not blind: a module outside the plugin that installs a feature itself is found."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "engine.py").write_text(
        "from megatron_longctx.megatron.features import FEATURES\n"
        "from megatron_longctx.megatron.tiled_mlp import tile_mlp_forward\n"
        "def build(model):\n    return tile_mlp_forward(model.mlp, 4)\n")
    assert build_paths(tmp_path) == ["bench/engine.py:1 FEATURES", "bench/engine.py:4 tile_mlp_forward"]


def test_launcher_patches_are_visible_to_patching():
    pytest.importorskip("megatron.core")
    from megatron_longctx import patching
    from megatron_longctx.megatron import launch

    before = patching.active()
    launch.install()
    try:
        added = sorted(set(patching.active()) - set(before))
        assert added and all("megatron_longctx.launch" in line for line in added), added
        assert any(line.startswith("type.__init__") or "__init__" in line for line in added), added
    finally:
        launch.uninstall()
    assert patching.active() == before


def test_worker_hooks_are_visible_to_patching():
    pytest.importorskip("megatron.training")
    from megatron.training import training

    from megatron_longctx import patching
    from megatron_longctx.job import worker

    original = training.train_step
    saved = worker._install_hooks(worker.StepLog({}), worker.StallWatchdog({}))
    try:
        lines = [line for line in patching.active() if "the main job's hooks" in line]
        assert {line.split(":")[0] for line in lines} >= {"module.train_step", "module.save_checkpoint"}, lines
        assert training.train_step is not original
    finally:
        for done in reversed(saved):
            done.undo()
    assert training.train_step is original
    assert not [line for line in patching.active() if "the main job's hooks" in line]
