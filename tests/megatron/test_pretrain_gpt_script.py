"""Megatron-LM's own, unmodified ``pretrain_gpt.py`` trains with the plugin on CPU (gloo, 2 ranks, tiny GPT).

Every comparison reads the full-precision per-iteration losses the launcher writes to
``$LONGCTX_LOSS_LOG`` and compares them with Megatron's CP=1 run of the same script (one rank, the
plugin's attention on one CP rank; the CP algorithms are checked against Megatron's own attention by
the model-level tests in ``test_gpt_cp.py``).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from torch.testing import assert_close

from tests.megatron_lm import (
    REF_016,
    REPO,
    TINY_GPT,
    assert_same_losses,
    copy_scripts,
    require_scripts,
    require_training,
    run_script,
)

ITERS = ("--train-iters", "3")
ROPE_GQA = ("--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2")
# gpt-oss's shape: learnable attention sinks, sliding-window layers alternating with full ones, SwiGLU, RMSNorm
GPT_OSS = (*ROPE_GQA, "--softmax-type", "learnable", "--window-size", "48,0", "--window-attn-skip-freq", "2",
           "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear")
VARIANTS = {"learned": (), "rope_gqa": ROPE_GQA, "gpt_oss": GPT_OSS}


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    require_scripts()
    require_training()
    return copy_scripts(tmp_path_factory.mktemp("megatron_lm"))


@pytest.fixture(scope="module")
def cp1_losses(script):
    """``{variant: lm losses}`` of the CP=1 run (one rank), computed once per variant."""
    cache: dict[str, list[float]] = {}

    def get(variant: str) -> list[float]:
        if variant not in cache:
            run = run_script(script, [*TINY_GPT, *ITERS, *VARIANTS[variant]], nproc=1).check()
            cache[variant] = run.lm_losses()
            print(f"CP=1 {variant}: {run.wall_s:.1f} s")
        return cache[variant]

    return get


@pytest.mark.parametrize("comm, variant", [("p2p", "learned"), ("all_gather", "learned"), ("a2a", "learned"),
                                           ("p2p", "rope_gqa"), ("p2p", "gpt_oss"), ("a2a", "gpt_oss"),
                                           ("all_gather", "gpt_oss")])
def test_cp2_equals_cp1(script, cp1_losses, comm, variant):
    run = run_script(script, [*TINY_GPT, *ITERS, *VARIANTS[variant], "--context-parallel-size", "2",
                              "--cp-comm-type", comm]).check()
    print(f"CP=2 {comm} {variant}: {run.wall_s:.1f} s")
    assert "defaults set (explicit flags win)" in run.output
    assert "--no-create-attention-mask-in-dataloader" in run.output  # the dense mask is off
    assert_same_losses(run.lm_losses(), cp1_losses(variant))


def test_save_load_resumes_exactly(script, tmp_path):
    ckpt = tmp_path / "ckpt"
    cp2 = [*TINY_GPT, "--context-parallel-size", "2", "--cp-comm-type", "p2p", "--train-iters", "6"]
    whole = run_script(script, [*cp2, "--save", str(ckpt), "--save-interval", "3"]).check()
    resumed = run_script(script, [*cp2, "--load", str(ckpt), "--ckpt-step", "3"]).check()
    print(f"save/load: {whole.wall_s:.1f} s + {resumed.wall_s:.1f} s")
    assert [row["iteration"] for row in resumed.losses] == [4, 5, 6]
    assert [row["iteration"] for row in whole.losses] == [1, 2, 3, 4, 5, 6]
    assert resumed.lm_losses() == whole.lm_losses()[3:]  # bit for bit


@pytest.mark.parametrize("recompute, plugin_runs", [
    (("--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp"), True),
    (("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"), False),
])
def test_megatron_recompute_flags(script, cp1_losses, recompute, plugin_runs):
    run = run_script(script, [*TINY_GPT, *ITERS, "--context-parallel-size", "2", *recompute]).check()
    print(f"recompute {recompute[1]}: {run.wall_s:.1f} s")
    # Without Transformer Engine Megatron's selective layernorm/mlp fail; the plugin runs them instead.
    assert ("runs in the plugin's recompute on 2 layers" in run.output) == plugin_runs
    assert_same_losses(run.lm_losses(), cp1_losses("learned"))


def test_recompute_in_sequence_tiles(script, cp1_losses):
    """Megatron's full recompute, replayed by the plugin in 4 sequence tiles per layer, over all-gather CP."""
    tiled = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
             "--longctx-recompute-tiles", "4")
    run = run_script(script, [*TINY_GPT, *ITERS, "--context-parallel-size", "2", "--cp-comm-type", "all_gather",
                              *tiled]).check()
    print(f"recompute in tiles: {run.wall_s:.1f} s")
    assert "runs in the plugin's recompute on 2 layers" in run.output
    assert_same_losses(run.lm_losses(), cp1_losses("learned"))


def _unusable_backend():
    import torch

    from megatron_longctx.kernels.select import BACKENDS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return next((name for name, b in BACKENDS.items() if b.available(device) is not None), None)


@pytest.mark.parametrize("bad, flag", [
    (("--longctx-cp-kernel-backend", "no_such_kernel"), "--longctx-cp-kernel-backend"),
    (("--longctx-cp-kernel-backend", "UNUSABLE"), "--longctx-cp-kernel-backend"),
    (("--attention-dropout", "0.1"), "--attention-dropout"),
    (("--longctx-tiled-mlp-tiles", "-1"), "--longctx-tiled-mlp-tiles"),
    # the default --cp-comm-type p2p: the replay in tiles needs all_gather
    (("--longctx-recompute-tiles", "4", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "1"), "--longctx-recompute-tiles"),
])
def test_bad_flags_fail_before_distributed_init(script, bad, flag):
    if "UNUSABLE" in bad:
        name = _unusable_backend()
        if name is None:
            pytest.skip("every kernel backend runs on this machine")
        bad = (bad[0], name)
    at = TINY_GPT.index("--attention-dropout")
    args = [*TINY_GPT[:at], *TINY_GPT[at + 2:]]  # the bad flag's own value decides
    run = run_script(script, [*args, *ITERS, "--context-parallel-size", "2", *bad], nproc=1)
    print(f"bad {bad}: {run.wall_s:.1f} s")
    assert run.returncode != 0
    errors = [line for line in run.output.splitlines() if line.startswith("megatron_longctx.launch: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"megatron_longctx.launch: error: {flag}:"), run.output[-3000:]
    assert "initializing torch distributed" not in run.output and not run.losses


def test_patched_script_trains_identically(script, cp1_losses, tmp_path):
    if shutil.which("patch") is None:
        pytest.skip("the patch tool is not installed")
    patched = copy_scripts(tmp_path / "patched")
    subprocess.run(["patch", "-p1", "-i", str(REPO / "patches" / "core_r0.19-pretrain_gpt.diff")],
                   cwd=patched.parent, check=True, capture_output=True)
    assert "longctx_layer_spec" in patched.read_text()
    # cpu_compat's runner: the CPU defaults, no plugin installed (the patch brings it in).
    run = run_script(patched, [*TINY_GPT, *ITERS, "--context-parallel-size", "2", "--cp-comm-type", "p2p",
                               "--no-create-attention-mask-in-dataloader"],
                     launcher=("-m", "megatron_longctx.megatron.cpu_compat")).check()
    print(f"patched: {run.wall_s:.1f} s")
    assert "megatron_longctx.megatron.cpu_compat: defaults set" in run.output
    assert_same_losses(run.lm_losses(), cp1_losses("learned"))


def test_patch_016_applies(tmp_path):
    if shutil.which("patch") is None:
        pytest.skip("the patch tool is not installed")
    folder = require_scripts(REF_016)
    for name in ("pretrain_gpt.py", "gpt_builders.py"):
        shutil.copy(folder / name, tmp_path / name)
    proc = subprocess.run(["patch", "-p1", "--dry-run", "-i", str(REPO / "patches" / "core_r0.16-pretrain_gpt.diff")],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pretrain_gpt.py" in proc.stdout and "gpt_builders.py" in proc.stdout


@pytest.mark.parametrize("target", ["host", "disk"])
def test_model_state_offload_equals_cp1(script, cp1_losses, target, tmp_path):
    """Weights and gradients streamed layer by layer (``disk``: with the optimizer's moments on disk and the
    step one unit at a time) train as Megatron's CP=1 does, through the unmodified script, with the tiled
    loss (computed where the output layer's weights are in a slot)."""
    where = ("--longctx-offload-disk-dir", str(tmp_path)) if target == "disk" else ()
    run = run_script(script, [*TINY_GPT, *ITERS, "--context-parallel-size", "2", "--longctx-tiled-loss-tiles", "2",
                              "--longctx-model-state-offload", target, *where]).check()
    print(f"model states {target}: {run.wall_s:.1f} s")
    assert "model states: weights and gradients streamed per layer" in run.output
    assert_same_losses(run.lm_losses(), cp1_losses("learned"))


def test_model_state_offload_with_recompute_in_sequence_tiles(script, cp1_losses):
    """The streamed layers replayed by the plugin in 4 sequence tiles per layer over all-gather CP (what the
    planner picks with the offload at length): each tile's backward finds the layer's weights and gradient
    slot in place."""
    tiled = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
             "--longctx-recompute-tiles", "4", "--longctx-tiled-loss-tiles", "2")
    run = run_script(script, [*TINY_GPT, *ITERS, "--context-parallel-size", "2", "--cp-comm-type", "all_gather",
                              *tiled, "--longctx-model-state-offload", "host"]).check()
    assert "model states: weights and gradients streamed per layer" in run.output
    assert_same_losses(run.lm_losses(), cp1_losses("learned"))


def test_model_state_offload_under_data_parallel(script):
    """Two data-parallel ranks: each unit's gradients are summed over the ranks as they leave the slot."""
    batch2 = [*TINY_GPT[:TINY_GPT.index("--global-batch-size")], "--global-batch-size", "2",
              *TINY_GPT[TINY_GPT.index("--global-batch-size") + 2:]]
    one_rank = run_script(script, [*batch2, *ITERS], nproc=1).check()
    run = run_script(script, [*batch2, *ITERS, "--longctx-model-state-offload", "host"], nproc=2).check()
    print(f"model states under DP=2: {run.wall_s:.1f} s")
    assert "model states: weights and gradients streamed per layer" in run.output
    assert_same_losses(run.lm_losses(), one_rank.lm_losses())


@pytest.mark.parametrize("target, precision", [("host", ()), ("host", ("--bf16",)), ("disk", ("--bf16",))],
                         ids=["host", "host-bf16", "disk-bf16"])  # disk in float32: tests/job's main-job run
def test_model_state_offload_with_the_distributed_optimizer(script, target, precision, tmp_path):
    """``--use-distributed-optimizer`` beside the offload at DP=2: each rank receives the summed gradients of its
    half of every layer (a reduce-scatter), keeps Adam's moments for that half and updates only it (of the
    float32 masters under bf16), and the halves are all-gathered after the step.  Four steps' losses equal the
    same run without the flag bit for bit, its gradient norms (summed over the two halves) to rounding, and two
    steps saved and two resumed equal the four (the save gathers the moments and the masters)."""
    batch2 = [*TINY_GPT[:TINY_GPT.index("--global-batch-size")], "--global-batch-size", "2",
              *TINY_GPT[TINY_GPT.index("--global-batch-size") + 2:], "--train-iters", "4", *precision]
    streamed = [*batch2, "--longctx-model-state-offload", target,
                *(("--longctx-offload-disk-dir", str(tmp_path / "states")) if target == "disk" else ())]
    whole = run_script(script, streamed, nproc=2).check()
    ckpt = tmp_path / "ckpt"
    sharded = run_script(script, [*streamed, "--use-distributed-optimizer", "--save", str(ckpt),
                                  "--save-interval", "2"], nproc=2).check()
    print(f"model states {target}, distributed optimizer, DP=2: {sharded.wall_s:.1f} s")
    assert "optimizer states sharded over 2 data x context parallel ranks" in sharded.output
    assert sharded.lm_losses() == whole.lm_losses()
    # each rank holds its range's summed gradients; the norm over them, summed over the ranks, is the whole's
    assert_close(torch.tensor(sharded.grad_norms()), torch.tensor(whole.grad_norms()), rtol=1e-6, atol=0)
    resumed = run_script(script, [*streamed, "--use-distributed-optimizer", "--load", str(ckpt), "--ckpt-step", "2"],
                         nproc=2).check()
    assert [row["iteration"] for row in resumed.losses] == [3, 4]
    assert resumed.lm_losses() == whole.lm_losses()[2:]


def test_model_state_offload_under_pipeline_parallel(script, tmp_path):
    """Two pipeline stages, each streaming its own units; the tied embedding's two copies (first and last
    stage), whose gradients Megatron sums on ``main_grad`` after backward, keep their accumulator on the
    host with ``disk``. Losses equal the same pipeline without the flag bit for bit."""
    pp = [*TINY_GPT, *ITERS, "--pipeline-model-parallel-size", "2"]
    plain = run_script(script, pp, nproc=2).check()
    where = {"host": (), "disk": ("--longctx-offload-disk-dir", str(tmp_path))}
    for target in ("host", "disk"):
        run = run_script(script, [*pp, "--longctx-model-state-offload", target, *where[target]], nproc=2).check()
        print(f"model states {target} under PP=2: {run.wall_s:.1f} s")
        assert "model states: weights and gradients streamed per layer" in run.output
        assert run.lm_losses() == plain.lm_losses()
