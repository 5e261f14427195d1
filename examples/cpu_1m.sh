#!/usr/bin/env bash
# One 1M-token (1,048,576) training step on a laptop's CPU: two ranks (gloo), no GPU.
# The main job (`megatron-longctx run`) trains a 2-layer Llama-shaped GPT (hidden 128, 4 heads / 2 query
# groups, SwiGLU, RMSNorm, RoPE) with a sliding window of 2,048 tokens, so attention costs grow linearly:
#   * ContextParallelAttention at CP=2 (ring, zigzag): each rank holds 524,288 tokens;
#   * Megatron's full recompute, each recomputed layer's input offloaded to disk (--longctx-offload-disk-dir);
#   * the MLP in 128 tiles of 4,096 tokens and the loss in 32 tiles of 16,384 tokens.
# No baseline run (Megatron's own attention at CP=1 is quadratic here) and no resume check. Measured on a
# 2-core machine shared with other jobs: the step 415 s, the whole run 513 s, peak resident memory 5.8 GiB per
# rank (the windowed 1M step of `megatron-longctx bench scaling`, docs/benchmark.md, is the same path).
# metrics.jsonl and summary.json (loss, time, peak memory per rank) go to OUTPUT_DIR.
# Extra arguments go to `megatron-longctx run` and win over these, e.g.
#   examples/cpu_1m.sh --window-size 4096,0 --train-iters 2
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/shared/cli.sh"  # cd to the repository root; `run`: megatron-longctx
OUTPUT_DIR="${OUTPUT_DIR:-runs/cpu_1m}"
SEQ=1048576
exec "${run[@]}" run --output-dir "$OUTPUT_DIR" --nproc-per-node 2 --no-baseline --no-resume-check \
    --num-layers 2 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2 \
    --ffn-hidden-size 352 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights \
    --disable-bias-linear \
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --window-size 2048,0 \
    --micro-batch-size 1 --global-batch-size 1 --train-iters 1 --lr 1e-4 --min-lr 1e-5 \
    --context-parallel-size 2 --cp-comm-type p2p \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --longctx-offload-policy checkpoint --longctx-offload-target disk \
    --longctx-offload-disk-dir "$OUTPUT_DIR/offload" \
    --longctx-tiled-mlp-tiles 128 --longctx-tiled-loss-tiles 32 \
    --distributed-timeout-seconds-after-init 1800 \
    "$@"
