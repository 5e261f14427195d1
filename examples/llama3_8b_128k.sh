#!/usr/bin/env bash
# Llama-3-8B, 128K-token sequences, one node of 8 x H200,
# inside the NGC container built from ../Dockerfile (see ../docs/container.md).
# Planner (python -m megatron_longctx.plan.recipes regenerates this from the flags below):
#   this recipe: TP2 CP4 (p2p) DP1, recompute none, offload none, MLP tiles 1, loss tiles 8; dataloader
#     mask off
#   predicted memory per GPU (GiB): weights (bf16) 7.5, grads (fp32 buffer) 15.0, optimizer (dist., fp32
#     m/v/master) 11.2, activations saved 73.3, layer working set 1.3, attention workspace 0.9, SP all-
#     gather (TP) 0.2, logits + loss 2.0, reserved 3.0
#   predicted peak 112.4 GiB of 140 GiB (fits)
#   predicted step 7.7 s (range 6.8-9.0 s), 2,121 tokens/s per GPU, 314 TFLOP/s per GPU, MFU 32% in
#     Megatron's num_floating_point_operations convention (attention 0.32 of peak in-step, backend auto)
#   the planner's pick for this job (megatron-longctx plan --model llama3-8b --seq-length 128K --num-
#     gpus 8 --gpu h200): TP2 CP1 (p2p) DP4, recompute none, offload layers, MLP tiles 4, loss tiles 1,
#     peak 109.0 GiB, 2,200 tokens/s per GPU (global batch 4)
# Megatron-LM's unmodified pretrain_gpt.py runs under megatron_longctx.launch, which adds the
# --longctx-* flags and puts ContextParallelAttention (and the memory features) into the layer spec.
set -euo pipefail

: "${NNODES:=1}"
: "${OUTPUT_DIR:=runs/llama3_8b_128k}"
# MEGATRON_LM, NODE_RANK, MASTER_ADDR, MASTER_PORT, TRAIN_ITERS, DATA_PATH/TOKENIZER: see shared/llama3.sh
source "$(dirname "${BASH_SOURCE[0]}")/shared/llama3.sh"

torchrun --nproc-per-node 8 --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m megatron_longctx.launch "$MEGATRON_LM/pretrain_gpt.py" \
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    "${LLAMA3_MODEL_FLAGS[@]}" \
    --seq-length 131072 --max-position-embeddings 131072 --micro-batch-size 1 --global-batch-size 1 \
    --no-create-attention-mask-in-dataloader \
    --tensor-model-parallel-size 2 --context-parallel-size 4 --bf16 --use-distributed-optimizer \
    --overlap-grad-reduce --overlap-param-gather --sequence-parallel --cp-comm-type p2p \
    "${LLAMA3_TRAIN_FLAGS[@]}" \
    "${DATA_ARGS[@]}" \
    --longctx-cp-algorithm ring --longctx-tiled-loss-tiles 8 \
    "$@"
