#!/usr/bin/env bash
# Llama-3-70B, 1M-token sequences, 8 nodes of 8 x H200,
# inside the NGC container built from ../Dockerfile (see "Running inside the NGC container" in ../README.md).
# Planner (megatron-longctx plan --model llama3-70b --seq-length 1M --num-gpus 64 --gpu h200):
#   recommended: TP4 CP16 (p2p) DP1, recompute none, offload layers, MLP tiles 4, loss tiles 8
#   predicted memory per GPU (GiB): weights (bf16) 32.9, grads (fp32 buffer) 65.7, optimizer (dist.,
#     fp32 m/v/master) 12.3, activations saved 4.2, layer working set 0.7, attention workspace 0.9,
#     logits + loss 2.0, reserved 3.0
#   predicted peak 120.0 GiB of 140 GiB; host memory for offload 148 GiB per GPU
#   predicted step 176.4 s (93 tokens/s per GPU, MFU 49%)
# Megatron-LM's unmodified pretrain_gpt.py runs under megatron_longctx.launch, which adds the
# --longctx-* flags and puts ContextParallelAttention (and the memory features) into the layer spec.
set -euo pipefail

: "${MEGATRON_LM:=/opt/Megatron-LM}"    # Megatron-LM scripts of core_r0.19.0 (pretrain_gpt.py; the image has them)
: "${NNODES:=8}"
: "${NODE_RANK:=0}"
: "${MASTER_ADDR:=localhost}"
: "${MASTER_PORT:=29500}"
: "${OUTPUT_DIR:=runs/llama3_70b_1m}"
: "${TRAIN_ITERS:=20}"

# Real data: DATA_PATH=<prefix of a Megatron indexed dataset> TOKENIZER=<HF tokenizer dir or name>.
# Without DATA_PATH the run uses Megatron's mock data (random tokens) to check memory and speed.
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer
               --tokenizer-model "${TOKENIZER:?set TOKENIZER with DATA_PATH}")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 128255)
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

torchrun --nproc-per-node 8 --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m megatron_longctx.launch "$MEGATRON_LM/pretrain_gpt.py" \
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 \
    --normalization RMSNorm --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 \
    --kv-channels 128 --group-query-attention --num-query-groups 8 --swiglu \
    --position-embedding-type rope --rotary-base 500000 --untie-embeddings-and-output-weights \
    --seq-length 1048576 --max-position-embeddings 1048576 --micro-batch-size 1 \
    --no-create-attention-mask-in-dataloader \
    --global-batch-size 1 --tensor-model-parallel-size 4 --context-parallel-size 16 --bf16 \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --sequence-parallel \
    --cp-comm-type p2p \
    --train-iters "$TRAIN_ITERS" --lr 1.0e-5 --min-lr 1.0e-6 --lr-decay-style cosine --lr-warmup-iters 2 \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 \
    --log-interval 1 --log-throughput --eval-iters 0 --eval-interval 1000000 \
    --save "$OUTPUT_DIR/checkpoints" --save-interval 1000000 --tensorboard-dir "$OUTPUT_DIR/tensorboard" \
    "${DATA_ARGS[@]}" \
    --longctx-cp-algorithm ring --longctx-offload-policy layers \
    --longctx-offload-host-pool-bytes 175019917312 --longctx-tiled-mlp-tiles 4 \
    --longctx-tiled-loss-tiles 8 \
    "$@"
