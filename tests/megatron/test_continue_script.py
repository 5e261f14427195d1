"""A checkpoint written by plain Megatron (Megatron-LM's unmodified ``pretrain_gpt.py`` without the plugin, CP=1,
its own attention, 128 tokens) continues through the launcher at CP=2 and 256 tokens with ``--finetune``, a
new RoPE base and Llama-3.1 scaling: the state dict loads strictly, the source is never written, and the
losses equal plain Megatron's at CP=1 continuing the same checkpoint at the same length."""

from __future__ import annotations

import hashlib
import os

from megatron_longctx.megatron.lm_scripts import BASELINE_LAUNCHER
from tests.megatron_lm import TINY_GPT, assert_same_losses, copy_scripts, require_training, run_script

ROPE = ("--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2")
SHORT = ("--seq-length", "128", "--max-position-embeddings", "128")
LONG = ("--seq-length", "256", "--max-position-embeddings", "256", "--rotary-base", "40000", "--use-rope-scaling",
        "--rope-scaling-factor", "4")
STRICT = ("--dist-ckpt-strictness", "raise_unexpected")  # a key the model asks for and the checkpoint lacks raises


def _args(*extra: str) -> list[str]:
    """TINY_GPT with ``extra`` in place of its own values (the length flags)."""
    args, given = list(TINY_GPT), {f for f in extra if f.startswith("--")}
    out, skip = [], False
    for i, item in enumerate(args):
        if skip:
            skip = False
            continue
        if item in given:
            skip = i + 1 < len(args) and not args[i + 1].startswith("--")
            continue
        out.append(item)
    return [*out, *ROPE, *extra]


def _digest(folder) -> dict[str, str]:
    return {os.path.relpath(os.path.join(root, name), folder):
            hashlib.sha256(open(os.path.join(root, name), "rb").read()).hexdigest()
            for root, _, files in os.walk(folder) for name in files}


def test_plain_megatron_checkpoint_continues_at_cp2_and_a_longer_length(tmp_path):
    require_training()
    script = copy_scripts(tmp_path / "megatron_lm")
    ckpt = tmp_path / "source"
    source = run_script(script, _args(*SHORT, "--train-iters", "2", "--save", str(ckpt), "--save-interval", "2"),
                        nproc=1, launcher=BASELINE_LAUNCHER).check()
    assert "megatron_longctx.megatron.cpu_compat: defaults set" in source.output
    assert "megatron_longctx.launch" not in source.output  # no plugin: Megatron's own attention
    before = _digest(ckpt)

    longer = _args(*LONG, "--train-iters", "3", "--load", str(ckpt), "--finetune", *STRICT)
    plugin = run_script(script, [*longer, "--context-parallel-size", "2", "--cp-comm-type", "p2p"]).check()
    plain = run_script(script, longer, nproc=1, launcher=BASELINE_LAUNCHER).check()
    print(f"source {source.wall_s:.1f} s, plugin CP=2 {plugin.wall_s:.1f} s, plain CP=1 {plain.wall_s:.1f} s")
    for run in (plugin, plain):
        assert f"successfully loaded checkpoint from {ckpt}" in run.output
        assert [row["iteration"] for row in run.losses] == [1, 2, 3]  # --finetune: the weights, from iteration 0
    # the launcher put the plugin in (Megatron's own attention refuses CP=2 without Transformer Engine)
    assert "megatron_longctx.launch: defaults set (explicit flags win)" in plugin.output
    assert_same_losses(plugin.lm_losses(), plain.lm_losses())
    assert _digest(ckpt) == before  # the source checkpoint is read, never written
