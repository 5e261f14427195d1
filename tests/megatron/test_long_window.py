"""A sliding-window model trains at 128K tokens through Megatron-LM's unmodified ``pretrain_gpt.py``.

2 CPU ranks, CP=2 ring, Megatron's full recompute with the checkpointed layer inputs offloaded to disk,
tiled MLP and tiled loss: the path of the million-token runs, at the smallest length where a quadratic
step would not fit.  Per rank 64K tokens: a dense ``[s/cp, s/cp]`` mask or score matrix of any dtype
would be at least 4 GiB on its own (and minutes of work), so the peak resident memory bound fails
the test as soon as anything on the path turns quadratic; the losses equal the CP=1 run of the same
script on the same data (positions past 64K, RoPE tables, the windowed blocks at every zigzag offset).
"""

from __future__ import annotations

import math

from tests.megatron_lm import assert_same_losses, copy_scripts, require_scripts, require_training, run_script

SEQ = 131072
TINY_WINDOWED = (
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--group-query-attention",
    "--num-query-groups", "1", "--ffn-hidden-size", "64", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--window-size", "256,0",
    "--micro-batch-size", "1", "--global-batch-size", "1", "--lr", "1e-4", "--train-iters", "1",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters", "0", "--log-interval", "1",
    "--seed", "1234",
)
MEMORY = (
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--longctx-offload-policy", "checkpoint", "--longctx-offload-target", "disk",
    "--longctx-tiled-mlp-tiles", "8", "--longctx-tiled-loss-tiles", "8",
)
# Measured 1.2 GiB for the largest rank (torch, Megatron and gloo included); a quadratic
# [64K, 64K] buffer alone is 4 GiB in bool, 16 GiB in float32.
PEAK_RSS_BOUND = 2 << 30


def test_windowed_128k_step_trains_in_linear_memory(tmp_path):
    require_scripts()
    require_training()
    script = copy_scripts(tmp_path / "megatron_lm")
    cp2 = run_script(script, [*TINY_WINDOWED, *MEMORY, "--context-parallel-size", "2", "--cp-comm-type", "p2p"],
                     timeout=600).check()
    print(f"CP=2 at {SEQ} tokens: {cp2.wall_s:.1f} s, peak {cp2.peak_rss_bytes / 2**20:.0f} MiB")
    losses = cp2.lm_losses()
    assert len(losses) == 1 and math.isfinite(losses[0]), losses
    assert 0 < cp2.peak_rss_bytes <= PEAK_RSS_BOUND, cp2.peak_rss_bytes

    cp1 = run_script(script, [*TINY_WINDOWED, *MEMORY], nproc=1, timeout=600).check()
    print(f"CP=1 at {SEQ} tokens: {cp1.wall_s:.1f} s")
    assert_same_losses(losses, cp1.lm_losses())
