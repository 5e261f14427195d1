#!/usr/bin/env bash
# Llama-3-8B, 1M-token sequences, one node of 8 x H200,
# inside the NGC container built from ../Dockerfile (see ../docs/container.md).
# Planner (python -m megatron_longctx.plan.recipes regenerates this from the flags below):
#   this recipe: TP1 CP8 (p2p) DP1, recompute full, offload none, MLP tiles 4, loss tiles 8; dataloader
#     mask off
#   predicted memory per GPU (GiB): weights (bf16) 15.0, grads (fp32 buffer) 29.9, optimizer (dist.,
#     fp32 m/v/master) 11.2, activations saved 34.0, layer working set 10.4, attention workspace 7.0,
#     logits + loss 15.7, reserved 3.0
#   predicted peak 110.5 GiB of 140 GiB (fits)
#   predicted step 533.7 s (range 466.8-623.1 s), 246 tokens/s per GPU, 214 TFLOP/s per GPU, MFU 22% in
#     Megatron's num_floating_point_operations convention (attention 0.32 of peak in-step, backend auto)
#   the planner's pick for this job (megatron-longctx plan --model llama3-8b --seq-length 1M --num-gpus
#     8 --gpu h200): TP2 CP1 (p2p) DP4, recompute full, offload checkpoint, MLP tiles 32, loss tiles
#     128, peak 109.1 GiB, 271 tokens/s per GPU (global batch 4)
# Megatron-LM's unmodified pretrain_gpt.py runs under megatron_longctx.launch, which adds the
# --longctx-* flags and puts ContextParallelAttention (and the memory features) into the layer spec.
set -euo pipefail

: "${NNODES:=1}"
: "${OUTPUT_DIR:=runs/llama3_8b_1m}"
# MEGATRON_LM, NODE_RANK, MASTER_ADDR, MASTER_PORT, TRAIN_ITERS, DATA_PATH/TOKENIZER: see shared/llama3.sh
source "$(dirname "${BASH_SOURCE[0]}")/shared/llama3.sh"

torchrun --nproc-per-node 8 --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m megatron_longctx.launch "$MEGATRON_LM/pretrain_gpt.py" \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    "${LLAMA3_MODEL_FLAGS[@]}" \
    --seq-length 1048576 --max-position-embeddings 1048576 --micro-batch-size 1 \
    --no-create-attention-mask-in-dataloader \
    --global-batch-size 1 --tensor-model-parallel-size 1 --context-parallel-size 8 --bf16 \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --cp-comm-type p2p \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    "${LLAMA3_TRAIN_FLAGS[@]}" \
    "${DATA_ARGS[@]}" \
    --longctx-cp-algorithm ring --longctx-tiled-mlp-tiles 4 --longctx-tiled-loss-tiles 8 \
    "$@"
