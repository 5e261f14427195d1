#!/usr/bin/env bash
# Llama-3-8B, 1M-token sequences, one node of 8 x H200,
# inside the NGC container built from ../Dockerfile (see "Running inside the NGC container" in ../README.md).
# Planner (megatron-longctx plan --model llama3-8b --seq-length 1M --num-gpus 8 --gpu h200):
#   recommended: TP1 CP8 (p2p) DP1, recompute full, offload none, MLP tiles 4, loss tiles 8
#   predicted memory per GPU (GiB): weights (bf16) 15.0, grads (fp32 buffer) 29.9, optimizer (dist.,
#     fp32 m/v/master) 11.2, activations saved 34.0, layer working set 10.4, attention workspace 5.0,
#     logits + loss 15.7, reserved 3.0
#   predicted peak 108.7 GiB of 140 GiB
#   predicted step 341.2 s (384 tokens/s per GPU, MFU 39%)
# Megatron-LM's unmodified pretrain_gpt.py runs under megatron_longctx.launch, which adds the
# --longctx-* flags and puts ContextParallelAttention (and the memory features) into the layer spec.
set -euo pipefail

: "${MEGATRON_LM:=/opt/Megatron-LM}"    # Megatron-LM scripts of core_r0.19.0 (pretrain_gpt.py; the image has them)
: "${NNODES:=1}"
: "${NODE_RANK:=0}"
: "${MASTER_ADDR:=localhost}"
: "${MASTER_PORT:=29500}"
: "${OUTPUT_DIR:=runs/llama3_8b_1m}"
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
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 \
    --normalization RMSNorm --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 \
    --kv-channels 128 --group-query-attention --num-query-groups 8 --swiglu \
    --position-embedding-type rope --rotary-base 500000 --untie-embeddings-and-output-weights \
    --seq-length 1048576 --max-position-embeddings 1048576 --micro-batch-size 1 \
    --no-create-attention-mask-in-dataloader \
    --global-batch-size 1 --tensor-model-parallel-size 1 --context-parallel-size 8 --bf16 \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --cp-comm-type p2p \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
    --train-iters "$TRAIN_ITERS" --lr 1.0e-5 --min-lr 1.0e-6 --lr-decay-style cosine --lr-warmup-iters 2 \
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 \
    --log-interval 1 --log-throughput --eval-iters 0 --eval-interval 1000000 \
    --save "$OUTPUT_DIR/checkpoints" --save-interval 1000000 --tensorboard-dir "$OUTPUT_DIR/tensorboard" \
    "${DATA_ARGS[@]}" \
    --longctx-cp-algorithm ring --longctx-tiled-mlp-tiles 4 --longctx-tiled-loss-tiles 8 \
    "$@"
