#!/usr/bin/env bash
# Llama-3-8B context extension 8K -> 128K -> 1M on one node of 8 x H200, inside the NGC container built
# from ../Dockerfile (see ../docs/container.md and ../docs/extend.md).
# Each stage is Megatron-LM's unmodified pretrain_gpt.py under megatron_longctx.launch, laid out by the
# planner for its length (megatron-longctx plan --model llama3-8b --seq-length L --num-gpus 8 --gpu h200),
# with a larger RoPE base per stage; stage 1 starts from SOURCE (a Megatron checkpoint of the 8K model,
# weights only), each later stage from the previous stage's final checkpoint.  At the time of writing the
# planner picks:
#   8K    TP1 CP1 DP8, recompute none, offload none
#   128K  TP2 CP1 DP4, recompute none, offload layers, MLP tiles 4
#   1M    TP2 CP1 DP4, recompute full, offload checkpoint, MLP tiles 32, loss tiles 128
# Running the script again skips finished stages and resumes an interrupted one from its last checkpoint.
# STEPS_8K / STEPS_128K / STEPS_1M: steps per stage; BASES: the RoPE base per stage (ProLong-style).
# Evaluate the result at length afterwards with megatron-longctx eval (docs/extend.md).
set -euo pipefail

: "${NNODES:=1}"
: "${OUTPUT_DIR:=runs/extend_llama3_8b}"
: "${SOURCE:?set SOURCE to the 8K checkpoint directory, iter_* folders inside}"
: "${STEPS_8K:=200}" "${STEPS_128K:=100}" "${STEPS_1M:=50}"
BASES=(500000 8000000 128000000)
# MEGATRON_LM, NODE_RANK, MASTER_ADDR, MASTER_PORT, DATA_PATH/TOKENIZER: see shared/llama3.sh
source "$(dirname "${BASH_SOURCE[0]}")/shared/llama3.sh"
plan=(megatron-longctx plan --model llama3-8b --num-gpus 8 --gpu h200)
command -v megatron-longctx >/dev/null 2>&1 || plan=(python -m megatron_longctx plan --model llama3-8b --num-gpus 8 --gpu h200)

previous="$SOURCE"
stage=0
for spec in "8192:$STEPS_8K" "131072:$STEPS_128K" "1048576:$STEPS_1M"; do
    length=${spec%%:*} steps=${spec##*:}
    save="$OUTPUT_DIR/stage$((stage + 1))-$length"
    # the planner's Megatron-LM and --longctx-* flags for this length (the lines after "flags:")
    read -r -a layout <<< "$("${plan[@]}" --seq-length "$length" | sed -n '/^flags:/,$p' | tail -n +2 | tr '\n' ' ')"
    tracked=$(cat "$save/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0)
    if (( tracked >= steps )); then
        echo "stage $((stage + 1)) ($length tokens): done"
    else
        if (( tracked > 0 )); then from=(--load "$save"); else from=(--load "$previous" --finetune); fi
        torchrun --nproc-per-node 8 --nnodes "$NNODES" --node-rank "$NODE_RANK" \
            --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
            -m megatron_longctx.launch "$MEGATRON_LM/pretrain_gpt.py" \
            "${layout[@]}" "${LLAMA3_MODEL_FLAGS[@]}" --rotary-base "${BASES[$stage]}" \
            "${LLAMA3_TRAIN_FLAGS[@]}" --train-iters "$steps" --save "$save" --save-interval 25 \
            "${from[@]}" "${DATA_ARGS[@]}" "$@"
    fi
    previous="$save"
    stage=$((stage + 1))
done
