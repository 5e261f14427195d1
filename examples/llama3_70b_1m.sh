#!/usr/bin/env bash
# Llama-3-70B, 1M-token sequences, 8 nodes of 8 x H200,
# inside the NGC container built from ../Dockerfile (see ../docs/container.md).
# Planner (python -m megatron_longctx.plan.recipes regenerates this from the flags below):
#   this recipe: TP4 CP16 (p2p) DP1, recompute none, offload layers, MLP tiles 4, loss tiles 8;
#     dataloader mask off
#   predicted memory per GPU (GiB): weights (bf16) 32.9, grads (fp32 buffer) 65.7, optimizer (dist.,
#     fp32 m/v/master) 12.3, activations saved 4.2, layer working set 0.7, attention workspace 1.4, SP
#     all-gather (TP) 1.0, logits + loss 2.0, reserved 3.0
#   predicted peak 121.1 GiB of 140 GiB (fits); host 148 GiB per GPU
#   predicted step 270.0 s (range 236.2-315.1 s), 61 tokens/s per GPU, 276 TFLOP/s per GPU, MFU 28% in
#     Megatron's num_floating_point_operations convention (attention 0.32 of peak in-step, backend auto)
#   the planner's pick for this job (megatron-longctx plan --model llama3-70b --seq-length 1M --num-gpus
#     64 --gpu h200): TP4 CP16 (p2p) DP1, recompute none, offload layers, MLP tiles 2, loss tiles 8,
#     optimizer on host, peak 109.5 GiB, 60 tokens/s per GPU (global batch 1)
# Megatron-LM's unmodified pretrain_gpt.py runs under megatron_longctx.launch, which adds the
# --longctx-* flags and puts ContextParallelAttention (and the memory features) into the layer spec.
set -euo pipefail

: "${NNODES:=8}"
: "${OUTPUT_DIR:=runs/llama3_70b_1m}"
# MEGATRON_LM, NODE_RANK, MASTER_ADDR, MASTER_PORT, TRAIN_ITERS, DATA_PATH/TOKENIZER: see shared/llama3.sh
source "$(dirname "${BASH_SOURCE[0]}")/shared/llama3.sh"

torchrun --nproc-per-node 8 --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m megatron_longctx.launch "$MEGATRON_LM/pretrain_gpt.py" \
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 \
    "${LLAMA3_MODEL_FLAGS[@]}" \
    --seq-length 1048576 --max-position-embeddings 1048576 --micro-batch-size 1 \
    --no-create-attention-mask-in-dataloader \
    --global-batch-size 1 --tensor-model-parallel-size 4 --context-parallel-size 16 --bf16 \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --sequence-parallel \
    --cp-comm-type p2p \
    "${LLAMA3_TRAIN_FLAGS[@]}" \
    "${DATA_ARGS[@]}" \
    --longctx-cp-algorithm ring --longctx-offload-policy layers \
    --longctx-offload-host-pool-bytes 175019917312 --longctx-tiled-mlp-tiles 4 \
    --longctx-tiled-loss-tiles 8 \
    "$@"
