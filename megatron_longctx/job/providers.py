"""The thin providers the main job hands to Megatron-LM's ``megatron.training.pretrain``.

* :func:`model_provider`: Megatron's ``GPTModel`` from Megatron's local layer spec, with the plugin's
  :class:`~megatron_longctx.megatron.core_attention.ContextParallelAttention` put into it by
  :func:`~megatron_longctx.megatron.spec.transform_spec` (the ``--longctx-*`` flags); the baseline
  comparison run (``LONGCTX_BASELINE=1``) builds the same model with Megatron's own attention.
* :func:`train_valid_test_datasets_provider`: Megatron's ``GPTDataset`` over the standard-library
  corpus at ``--data-path`` (see :mod:`megatron_longctx.data`), byte-level tokens; with ``--mix-short`` a
  second one at the short length, the steps drawing from one or the other (:mod:`megatron_longctx.job.mix`).
* :func:`forward_step` / :func:`loss_func`: ``pretrain_gpt.py``'s convention (per-token loss sum and
  token count, Megatron reduces), with the batch cut by CP rank through Megatron's zigzag and kept on
  the CPU when the process has no GPU.

Everything else (optimizer, LR schedule, checkpoints, logging, NaN checks, timeouts) is Megatron's.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any, Optional

import torch

from megatron_longctx import data as data_mod
from megatron_longctx.job import mix as mix_mod

BASELINE_ENV = "LONGCTX_BASELINE"
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
job_mix: Optional[mix_mod.Mix] = None  # the run's --mix-short (None: every step at --seq-length), set by the worker
batch_lengths: list[int] = []  # the sequence length of each micro-batch read since the step began (the metrics')


def is_baseline() -> bool:
    return os.environ.get(BASELINE_ENV) == "1"


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None,
                   config: Any = None, pg_collection: Any = None) -> Any:
    """``GPTModel`` with the local spec, built as the launcher builds it
    (:meth:`~megatron_longctx.megatron.plugin.LongContextPlugin.build`: the plugin's attention and memory features,
    Megatron's recompute off where the plugin runs it); the baseline run builds it with Megatron's own."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_longctx.megatron.arguments import config_from_args
    from megatron_longctx.megatron.plugin import LongContextPlugin

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    kwargs: dict[str, Any] = {}
    if pg_collection is not None:
        kwargs["pg_collection"] = pg_collection
    if vp_stage is not None:
        kwargs["vp_stage"] = vp_stage
    # Megatron pads to make_vocab_size_divisible_by x TP (megatron.training.vocab_utils), so that every TP
    # rank's shard of the embedding and output layer has whole multiples of the divisor.
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size

    def build(config: Any, specs: dict[str, Any]) -> Any:
        return GPTModel(config, specs["transformer_layer_spec"],
                        vocab_size=data_mod.padded_vocab_size(data_mod.ByteTokenizer(), multiple),
                        max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                        post_process=post_process,
                        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                        rotary_percent=args.rotary_percent, rope_scaling=args.use_rope_scaling,
                        rope_scaling_factor=args.rope_scaling_factor,
                        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor, **kwargs)

    specs = {"transformer_layer_spec": get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm)}
    if is_baseline():
        # Megatron's own attention and recompute; what only the plugin can run here (selective layernorm /
        # mlp without Transformer Engine) is left out: recompute does not change the loss.
        if getattr(args, "recompute_granularity", None) == "selective":
            config = LongContextPlugin(config_from_args(args)).model_config(config)
        return build(config, specs)
    return LongContextPlugin(config_from_args(args)).build(build, config, specs)


def train_valid_test_datasets_provider(train_val_test_num_samples: list, vp_stage: Optional[int] = None) -> tuple:
    """Megatron's ``GPTDataset`` over ``--data-path`` (the stdlib corpus) for the training split only."""
    from megatron.training import get_args

    args = get_args()
    if not args.data_path:
        raise ValueError("--data-path is required: the main job passes the standard-library corpus it built")
    train = data_mod.build_gpt_dataset(args.data_path[0], args.seq_length, train_val_test_num_samples[0], args.seed,
                                       data_mod.ByteTokenizer(), cache_dir=args.data_cache_path)
    mix = job_mix
    if mix is not None:  # --mix-short: the short steps' samples from a second dataset at the short length
        short = data_mod.build_gpt_dataset(args.data_path[0], mix.short, train_val_test_num_samples[0], args.seed,
                                           data_mod.ByteTokenizer(), cache_dir=args.data_cache_path)
        train = mix_mod.MixedLengthDataset(train, short, args.global_batch_size, mix)
    return train, None, None


train_valid_test_datasets_provider.is_distributed = True  # every rank builds it (Megatron syncs the index files)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def get_batch(data_iterator: Any) -> dict[str, torch.Tensor]:
    """This rank's micro-batch: ``[mbs, s]`` tensors from the loader, zigzag-cut to ``[mbs, s/cp]``."""
    from megatron.core import parallel_state

    from megatron_longctx.megatron.batch import get_batch_on_this_cp_rank

    sample = next(data_iterator)
    batch = {k: sample[k].to(_device(), non_blocking=True) for k in BATCH_KEYS}  # [mbs, s]
    batch_lengths.append(int(batch["tokens"].shape[1]))
    return get_batch_on_this_cp_rank(batch, parallel_state.get_context_parallel_group())  # [mbs, s/cp]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
    """Local masked loss sum, local token count, and the report Megatron reduces over ``dp_cp``."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    losses = output_tensor.view(-1).float()  # [mbs * s/cp]
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        machine = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=loss, rejection_func=reject, tolerance=0.0, fatal=True,
                                    message=f"found {what} in local forward loss calculation")
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> tuple:
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [mbs, s/cp]
    return output, partial(loss_func, batch["loss_mask"])
