#!/usr/bin/env bash
# CPU demo: the main job on two CPU ranks (gloo), no GPU needed.
# A small GPT trains on 8K-token sequences with ContextParallelAttention at CP=2, then baseline Megatron
# (CP=1) trains on the same batches and the loss curves and memory per rank are compared.
# Extra arguments go to `megatron-longctx run` (see `megatron-longctx run --help`), e.g.
#   examples/cpu_demo.sh --seq-length 16384 --cp-comm-type all_gather
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/shared/cli.sh"  # cd to the repository root; `run`: megatron-longctx
# What the planner makes of the same shape (an analytic estimate; on CPU it is only indicative).
"${run[@]}" plan --model custom --num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 \
    --kv-channels 16 --ffn-hidden-size 256 --vocab-size 256 --seq-length 8192 --num-gpus 2 --gpu h100 \
    --cp 2 --tp 1 | sed -n '1,2p'
exec "${run[@]}" run --output-dir runs/cpu_demo "$@"
