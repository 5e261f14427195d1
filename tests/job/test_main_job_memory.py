"""Every memory feature of the README reached from the main job (``megatron-longctx run``), as the launcher
reaches it: Megatron's recompute flags are read and run by the plugin where it must, and the losses equal
baseline Megatron's (its own attention at CP=1, no memory features) on the same batches.

One run trains with the features of the README's 1M-token configuration and its baseline; the others are
compared against that baseline.  Each run's rank 0 names the features it put on the model, and the
offload counters in ``metrics.jsonl`` show that the offload moved bytes (the feature ran, not only parsed).
"""

import os

import pytest
import torch

from tests.job import main_job

MODEL = ["--num-layers", "2", "--normalization", "RMSNorm", "--swiglu", "--train-iters", "2", "--no-resume-check",
         "--longctx-offload-min-bytes", "0"]  # the tiny model's activations are all under the default minimum
FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]

CASES = {
    # the 1M-token configuration: Megatron's full recompute, its inputs offloaded to disk, tiled MLP and loss
    "checkpoint-offload-disk": (
        [*FULL, "--longctx-offload-policy", "checkpoint", "--longctx-offload-target", "disk",
         "--longctx-tiled-mlp-tiles", "4", "--longctx-tiled-loss-tiles", "4"],
        ["tiled MLP: 4 tiles on 2 MLPs", "tiled loss: 4 tiles", "full recompute: 2 of 2 layers (uniform)",
         "offload: checkpoint to disk", "runs in the plugin's recompute on 2 layers"],
        ["offloaded_bytes"]),
    "selective-modules-host": (
        ["--recompute-granularity", "selective", "--recompute-modules", "layernorm",
         "--longctx-offload-policy", "modules", "--longctx-offload-modules", "mlp",
         "--longctx-lean-norm", "--longctx-tiled-loss-tiles", "4", "--longctx-tiled-loss-recompute"],
        ["selective recompute: layernorm in 2 layers", "offload: modules mlp to host", "lean RMSNorm: 5 norms",
         "tiled loss: 4 tiles, logits recomputed in backward"],
        ["host_noop_bytes"]),  # to host from the CPU: packed and counted, left where it is
    "layers-offload-block": (
        ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1",
         "--longctx-offload-policy", "checkpoint"],
        ["full recompute: 1 of 2 layers (block)", "offload: checkpoint to host"],
        ["host_noop_bytes"]),
    "recompute-tiles": (
        [*FULL, "--longctx-cp-algorithm", "allgather", "--longctx-recompute-tiles", "2",
         "--longctx-offload-policy", "checkpoint", "--longctx-offload-target", "disk",
         "--longctx-tiled-output-over-input",
         "--longctx-offload-residual-grad", "--longctx-tiled-loss-tiles", "2", "--longctx-tiled-loss-recompute"],
        ["replayed in 2 sequence tiles, output written over input", "residual gradient offload"],
        ["offloaded_bytes", "row_fetches", "residual_grad_bytes"]),
}
REFERENCE = "checkpoint-offload-disk"


def _train(root, name, *extra):
    out = str(root / name)
    proc = main_job.run(out, str(root / "data"), *MODEL, *CASES[name][0], *extra)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, main_job.metrics(out)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    main_job.skip_without_megatron_training()
    return tmp_path_factory.mktemp("memory-features")


@pytest.fixture(scope="module")
def reference(root):
    """The 1M-token configuration and baseline Megatron over the same two steps."""
    stdout, rows = _train(root, REFERENCE, "--baseline-steps", "2")
    return {"stdout": stdout, "rows": rows,
            "baseline": [r["loss"] for r in rows if r["run"] == "baseline-cp1"]}


@pytest.mark.parametrize("name", list(CASES))
def test_memory_feature_through_the_main_job(root, reference, name):
    stdout, rows = (reference["stdout"], reference["rows"]) if name == REFERENCE else _train(root, name,
                                                                                             "--no-baseline")
    described = next(line for line in stdout.splitlines() if "memory features:" in line)
    for what in CASES[name][1]:
        assert what in stdout, (what, described)
    plugin = [r for r in rows if r["run"] == "plugin-cp2"]
    assert [r["step"] for r in plugin] == [1, 2]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in plugin]), torch.tensor(reference["baseline"]),
                               rtol=1e-5, atol=1e-6)
    for counter in CASES[name][2]:  # the feature ran: rank 0's offloader packed (and moved) bytes
        assert plugin[-1]["offload"][counter] > 0, (counter, plugin[-1]["offload"])
    assert not os.path.exists(os.path.join(root, name, "checkpoint", "offload")) or not any(
        files for _, _, files in os.walk(os.path.join(root, name, "checkpoint", "offload"))), "offload files left"
