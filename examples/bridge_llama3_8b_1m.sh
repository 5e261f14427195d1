#!/usr/bin/env bash
# Llama-3-8B, 1M-token sequences, one node of 8 x H200, from Megatron-Bridge's own Llama-3-8B recipe
# (megatron.bridge.recipes.llama:llama3_8b_pretrain_config), inside a container with Megatron-Bridge
# (NeMo's NGC image has it, with Transformer Engine and nvidia-resiliency-ext).
# Planner: the layout of llama3_8b_1m.sh (the same model, parallelism and memory features), whose header
# has the planner's numbers:
#   TP1 CP8 (p2p) DP1, recompute full, offload none, MLP tiles 4, loss tiles 8;
#   predicted peak 110.5 GiB of 140 GiB (fits), predicted step 533.7 s (range 466.8-623.1 s)
# python -m megatron_longctx.bridge builds the recipe's ConfigContainer, applies Bridge's dotted
# overrides below, adds megatron-longctx (megatron_longctx.bridge.configure, with the --longctx-* flags)
# and runs Bridge's pretrain() with its GPT forward_step.  Megatron's full recompute stays Megatron's
# (no offload asks the plugin to run it); the dataloader builds no [s, s] attention mask.
set -euo pipefail

: "${NNODES:=1}"
: "${OUTPUT_DIR:=runs/bridge_llama3_8b_1m}"
SEQ=1048576
# NODE_RANK, MASTER_ADDR, MASTER_PORT, TRAIN_ITERS and the CUDA environment: see shared/llama3.sh
source "$(dirname "${BASH_SOURCE[0]}")/shared/llama3.sh"

torchrun --nproc-per-node 8 --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m megatron_longctx.bridge --recipe megatron.bridge.recipes.llama:llama3_8b_pretrain_config \
    model.seq_length=$SEQ dataset.seq_length=$SEQ dataset.create_attention_mask=false \
    model.tensor_model_parallel_size=1 model.context_parallel_size=8 model.pipeline_model_parallel_size=1 \
    model.sequence_parallel=false model.cp_comm_type=p2p model.attention_dropout=0.0 \
    model.attention_backend=auto model.recompute_granularity=full model.recompute_method=uniform \
    model.recompute_num_layers=1 \
    train.train_iters=$TRAIN_ITERS train.global_batch_size=1 train.micro_batch_size=1 \
    validation.eval_iters=0 checkpoint.save="$OUTPUT_DIR/checkpoints" checkpoint.save_interval=1000000 \
    logger.log_interval=1 logger.tensorboard_dir="$OUTPUT_DIR/tensorboard" \
    --longctx-cp-algorithm ring --longctx-tiled-mlp-tiles 4 --longctx-tiled-loss-tiles 8 \
    "$@"
