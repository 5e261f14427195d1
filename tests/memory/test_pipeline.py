"""Offload + recompute under Megatron's own 1F1B pipeline schedule: PP=2 on CPU/gloo, 4 micro-batches.

Stage 0 runs the forwards of several micro-batches before their backwards (the warm-up of 1F1B), so
offloaded tensors of different micro-batches are in flight together.  Oracle: the same schedule
without memory features.
"""

import torch

from megatron_longctx.memory import MemoryConfig
from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import ORACLE_SEQ, assert_same, batch, cpu

MICROBATCHES = 4


def _stage_model():
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(1234 + parallel_state.get_pipeline_model_parallel_rank())
    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
        use_cpu_initialization=True, hidden_dropout=0.1, attention_dropout=0.1, params_dtype=torch.float64,
        pipeline_dtype=torch.float64, pipeline_model_parallel_size=2, bias_dropout_fusion=False,
        batch_p2p_sync=False,  # its torch.cuda.synchronize() guards a CUDA race; gloo on CPU has none
    )
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=32,
                     position_embedding_type="rope", pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    return model.to(torch.float64)


def _forward_step(data_iterator, model):
    b = next(data_iterator)
    tokens, pos = b["tokens"], b["position_ids"]
    out = model(tokens, pos, None, labels=torch.roll(tokens, -1, dims=1))

    def loss_func(per_token):
        loss = per_token.double().mean()
        return loss, {"loss": loss.detach()}

    return out, loss_func


def _run_schedule(cfg):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_longctx.megatron.memory_spec import install

    model = _stage_model()
    handle = install(model, cfg) if cfg is not None else None
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    data = iter([batch(seed=i, seq=ORACLE_SEQ) for i in range(MICROBATCHES)])
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=data, model=[model], num_microbatches=MICROBATCHES,
        seq_length=32, micro_batch_size=2, forward_only=False,
    )
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    total = torch.stack([x["loss"] for x in losses]).sum() if losses else torch.zeros((), dtype=torch.float64)
    stats = handle.offloader.stats if handle is not None and handle.offloader is not None else None
    if handle is not None:
        handle.remove()
    return (total, grads), stats


def _pp2_matches():
    with cpu(), megatron_parallel(pp=2):
        ref, _ = _run_schedule(None)
        for cfg in (MemoryConfig(recompute_granularity="full", offload_policy="checkpoint", offload_target="disk",
                                 offload_min_bytes=0, tiled_mlp_tiles=2),
                    MemoryConfig(offload_policy="layers", offload_target="disk", offload_min_bytes=0)):
            got, stats = _run_schedule(cfg)
            assert_same(ref, got)
            assert stats.offloaded_bytes > 0


def test_pipeline_parallel_2_with_offload_and_recompute():
    run_ranks(2, _pp2_matches)
