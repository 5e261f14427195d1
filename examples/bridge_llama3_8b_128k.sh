#!/usr/bin/env bash
# Llama-3-8B, 128K-token sequences, one node of 8 x H200, from Megatron-Bridge's own Llama-3-8B recipe
# (megatron.bridge.recipes.llama:llama3_8b_pretrain_config), inside a container with Megatron-Bridge
# (NeMo's NGC image has it, with Transformer Engine and nvidia-resiliency-ext).
# Planner: the layout of llama3_8b_128k.sh (the same model, parallelism and memory features), whose header
# has the planner's numbers:
#   TP2 CP4 (p2p) DP1, recompute none, offload none, MLP tiles 1, loss tiles 8;
#   predicted peak 112.4 GiB of 140 GiB (fits), predicted step 7.7 s (range 6.8-9.0 s)
# python -m megatron_longctx.bridge builds the recipe's ConfigContainer, applies Bridge's dotted
# overrides below, adds megatron-longctx (megatron_longctx.bridge.configure, with the --longctx-* flags)
# and runs Bridge's pretrain() with its GPT forward_step.  The recipe's Transformer Engine layer spec is
# kept; ContextParallelAttention replaces its core_attention.
set -euo pipefail

: "${NNODES:=1}"
: "${OUTPUT_DIR:=runs/bridge_llama3_8b_128k}"
SEQ=131072
# NODE_RANK, MASTER_ADDR, MASTER_PORT, TRAIN_ITERS and the CUDA environment: see shared/llama3.sh
source "$(dirname "${BASH_SOURCE[0]}")/shared/llama3.sh"

torchrun --nproc-per-node 8 --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m megatron_longctx.bridge --recipe megatron.bridge.recipes.llama:llama3_8b_pretrain_config \
    model.seq_length=$SEQ dataset.seq_length=$SEQ \
    model.tensor_model_parallel_size=2 model.context_parallel_size=4 model.pipeline_model_parallel_size=1 \
    model.sequence_parallel=true model.cp_comm_type=p2p model.attention_dropout=0.0 \
    model.attention_backend=auto model.recompute_granularity=null \
    train.train_iters=$TRAIN_ITERS train.global_batch_size=1 train.micro_batch_size=1 \
    validation.eval_iters=0 checkpoint.save="$OUTPUT_DIR/checkpoints" checkpoint.save_interval=1000000 \
    logger.log_interval=1 logger.tensorboard_dir="$OUTPUT_DIR/tensorboard" \
    --longctx-cp-algorithm ring --longctx-tiled-loss-tiles 8 \
    "$@"
