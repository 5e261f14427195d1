"""The checkpoint the continuation and evaluation tests start from."""

import hashlib
import os

import pytest

from megatron_longctx.job import checkpoint_guard as guard
from megatron_longctx.job import command_line, pretrain, spawn
from tests.job import main_job

SHORT = ["--seq-length", "128", "--max-position-embeddings", "128"]
LONG = ["--seq-length", "256", "--max-position-embeddings", "256"]


def digest(folder: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="package")
def source(tmp_path_factory):
    """2 steps of plain Megatron (its own attention, CP=1 over 2 data-parallel ranks) at 128 tokens, saved at
    step 2 as Megatron-LM saves it (no manifest of the main job)."""
    main_job.skip_without_megatron_training()
    root = tmp_path_factory.mktemp("continue")
    out, data = str(root / "source"), str(root / "data")
    own, margv = pretrain.build_parser().parse_known_args(
        [*main_job.TINY, *SHORT, "--output-dir", out, "--data-dir", data, "--context-parallel-size", "1",
         "--train-iters", "2"])
    job = command_line.Job.from_argv(margv, own)
    job.data_path = command_line.ensure_corpus(own, job.values.seq_length)
    os.makedirs(out)
    argv = [*job.baseline_argv(2), "--save", job.save, "--save-interval", "2"]
    settings = {"name": "source", "metrics": os.path.join(out, "metrics.jsonl"), "progress": False, "total_steps": 2}
    rc, reports = spawn.run_phase(argv, 2, settings, {"LONGCTX_BASELINE": "1"})
    assert rc == 0, reports
    os.remove(os.path.join(guard.iteration_dir(job.save, 2), guard.MANIFEST))
    return {"ckpt": job.save, "data": data, "root": root, "digest": digest(job.save)}
