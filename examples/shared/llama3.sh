# What the Llama-3 recipes (examples/llama3_*.sh, bridge_llama3_*.sh) share, sourced by each after it sets
# NNODES and OUTPUT_DIR (the Bridge recipes use the environment only):
# the defaults of the environment, the data arguments, and two arrays of Megatron-LM flags:
#   LLAMA3_MODEL_FLAGS  the Llama-3 architecture apart from its size (each recipe gives --num-layers,
#                       --hidden-size, --ffn-hidden-size and --num-attention-heads for 8B or 70B);
#   LLAMA3_TRAIN_FLAGS  optimizer, schedule, logging and checkpointing.
# python -m megatron_longctx.plan.recipes reads these arrays where a recipe's command names them.

: "${MEGATRON_LM:=/opt/Megatron-LM}"    # Megatron-LM scripts of core_r0.19.0 (pretrain_gpt.py; the image has them)
: "${NODE_RANK:=0}"
: "${MASTER_ADDR:=localhost}"
: "${MASTER_PORT:=29500}"
: "${TRAIN_ITERS:=20}"

# Real data: DATA_PATH=<prefix of a Megatron indexed dataset> TOKENIZER=<HF tokenizer dir or name>.
# Without DATA_PATH the run uses Megatron's mock data (random tokens) to check memory and speed.
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path "$DATA_PATH" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer
               --tokenizer-model "${TOKENIZER:?set TOKENIZER with DATA_PATH}")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 128255)
fi

LLAMA3_MODEL_FLAGS=(
    --normalization RMSNorm --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
    --kv-channels 128 --group-query-attention --num-query-groups 8 --swiglu
    --position-embedding-type rope --rotary-base 500000 --untie-embeddings-and-output-weights
)

LLAMA3_TRAIN_FLAGS=(
    --train-iters "$TRAIN_ITERS" --lr 1.0e-5 --min-lr 1.0e-6 --lr-decay-style cosine --lr-warmup-iters 2
    --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02
    --log-interval 1 --log-throughput --eval-iters 0 --eval-interval 1000000
    --save "$OUTPUT_DIR/checkpoints" --save-interval 1000000 --tensorboard-dir "$OUTPUT_DIR/tensorboard"
)

export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
