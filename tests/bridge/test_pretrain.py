"""Megatron-Bridge's own ``pretrain()`` with megatron-longctx, on 2 gloo CPU ranks: the ``vanilla_gpt`` recipe
at tiny size, 3 steps; context parallelism (ring = Bridge's p2p, allgather, ulysses = a2a) gives the losses of
CP=1 (data parallel over the same global batch), and so do the memory features; the model-state offload keeps
them to the bit (host and disk, and disk resumes to the bit); a run saved and resumed from its checkpoint's ``run_config.yaml`` continues bit for bit.  Runs where ``megatron.bridge`` imports
(``make test-bridge``); skips elsewhere."""

from __future__ import annotations

import functools
import json
import os

import pytest

from tests.bridge.bridge_kit import bridge_available, import_bridge
from tests.dist import run_ranks

pytestmark = pytest.mark.skipif(bridge_available() is not None, reason=str(bridge_available()))

STEPS, SEQ, GLOBAL_BATCH, MICRO_BATCH = 3, 32, 4, 1


def tiny_recipe(cp: int):
    """Bridge's vanilla_gpt recipe, tiny, fp32, no checkpoints or evaluation, Megatron's local layers."""
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.bridge.recipes.gpt.vanilla_gpt import vanilla_gpt_pretrain_config

    cfg = vanilla_gpt_pretrain_config()
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads = 2, 64, 128, 4
    m.seq_length, m.context_parallel_size, m.transformer_impl = SEQ, cp, "local"
    m.position_embedding_type, m.transformer_layer_spec = "rope", local_layer_spec  # Bridge's default is TE's
    m.bf16, m.params_dtype, m.attention_dropout, m.hidden_dropout = False, __import__("torch").float32, 0.0, 0.0
    m.gradient_accumulation_fusion = m.bias_activation_fusion = m.bias_dropout_fusion = False
    m.masked_softmax_fusion = m.persist_layer_norm = m.apply_rope_fusion = False
    cfg.mixed_precision = None
    cfg.optimizer.bf16 = False
    cfg.optimizer.use_distributed_optimizer = cfg.ddp.use_distributed_optimizer = False
    cfg.ddp.grad_reduce_in_fp32 = False
    cfg.dataset.seq_length, cfg.dataset.split = SEQ, "100,0,0"  # no validation split: no evaluation
    cfg.dataset.num_workers, cfg.dataset.pin_memory, cfg.dataset.persistent_workers = 0, False, False
    cfg.tokenizer.vocab_size = 128
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = STEPS, GLOBAL_BATCH, MICRO_BATCH
    cfg.validation.eval_iters, cfg.validation.eval_interval = 0, None
    cfg.scheduler.lr_warmup_iters = 0
    cfg.checkpoint.save = None
    cfg.checkpoint.save_interval = None
    cfg.logger.tensorboard_dir, cfg.logger.log_interval = None, 1
    cfg.dist.distributed_backend = "gloo"
    cfg.dataset.path_to_cache = None  # mock data: each rank builds its indices (no cache to share)
    return cfg


def _train(cp: int, steps: int = STEPS, save_at: int | None = None, save: str | None = None, resume: str | None = None,
           clip_grad: float | None = None, distributed_optimizer: bool = False, **longctx) -> list[float]:
    """Rank body: Bridge's pretrain() of the tiny recipe; the global loss of each step (mean over its tokens).

    ``save_at``: stop after that step and save to ``save`` (Bridge's ``train.exit_interval``; the run is otherwise
    the ``steps`` run: the same schedule and data).  ``resume``: a checkpoint directory whose
    last iteration's ``run_config.yaml`` gives the layer spec (our spec object and options), trained on to ``steps``.
    ``clip_grad``: the optimizer's (None: the recipe's, 1.0).  ``distributed_optimizer``: the recipe's
    ``ddp`` and ``optimizer.use_distributed_optimizer``."""
    import_bridge()
    import torch
    import torch.distributed as dist
    from megatron.bridge.training import gpt_step
    from megatron.bridge.training.pretrain import pretrain
    from megatron.core import parallel_state

    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.bridge import configure

    sums: list[torch.Tensor] = []

    @functools.wraps(gpt_step.forward_step)
    def forward_step(state, data_iterator, model, return_schedule_plan=False):
        output, loss_fn = gpt_step.forward_step(state, data_iterator, model, return_schedule_plan)

        def recorded(output_tensor):
            loss, tokens, report = loss_fn(output_tensor)
            sums.append(torch.stack([loss.detach().double().sum(), tokens.detach().double().sum()]))
            return loss, tokens, report

        return output, recorded

    cfg = tiny_recipe(cp)
    if resume is not None:  # the recipe again, with the spec object (and our options) from run_config.yaml
        cfg.model.transformer_layer_spec = _saved_layer_spec(resume)
        cfg.checkpoint.load = resume
    if clip_grad is not None:
        cfg.optimizer.clip_grad = clip_grad
    cfg.train.train_iters, cfg.train.exit_interval = steps, save_at
    cfg.checkpoint.save = save
    cfg.ddp.use_distributed_optimizer = cfg.optimizer.use_distributed_optimizer = distributed_optimizer
    cfg = configure(cfg, **longctx)
    if longctx.get("model_state_offload", "none") != "none":  # the plugin runs it over the streamed states
        assert not cfg.ddp.use_distributed_optimizer and not cfg.optimizer.use_distributed_optimizer
    if longctx.get("model_state_offload") == "disk":
        cfg.model.register_pre_wrap_hook(_layers_built_into_files)
    with cpu_compat.enabled():
        try:
            pretrain(cfg, forward_step)
        except SystemExit as stop:  # Bridge ends a run at its exit_interval with sys.exit(0)
            if save_at is None or stop.code not in (0, None):
                raise
    parallel_state.destroy_model_parallel()
    micro_batches = GLOBAL_BATCH // (MICRO_BATCH * (dist.get_world_size() // cp))  # per step on this rank
    per_step = torch.stack(sums).view(len(sums) // micro_batches, micro_batches, 2).sum(1)
    dist.all_reduce(per_step)
    return [float(s / n) for s, n in per_step]


def _layers_built_into_files(model: list) -> list:
    """Bridge's pre-wrap hook: with ``disk`` no transformer layer holds its weights once built (each wrote
    them to its file as it was built)."""
    from megatron_longctx.memory.model_state_store import STASHED, is_placeholder

    layers = [layer for chunk in model for layer in chunk.decoder.layers]
    assert layers and all(os.path.getsize(getattr(layer, STASHED).path) > 0 for layer in layers)
    assert all(is_placeholder(p) for layer in layers for p in layer.parameters())
    return model


def _saved_layer_spec(checkpoint_dir: str):
    """The model's ``transformer_layer_spec`` as Bridge wrote it beside the checkpoint's last iteration, loaded
    back with Megatron's own loader (the rest of that file holds runtime objects, the mock tokenizer, that
    Bridge itself does not load back)."""
    import_bridge()  # Bridge's import lets its own targets (the recipe's layer spec) load
    from megatron.training.config.instantiate_utils import instantiate
    from omegaconf import OmegaConf

    from megatron_longctx.bridge.spec import allow_in_run_config

    with open(os.path.join(checkpoint_dir, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read().strip())
    saved = OmegaConf.load(os.path.join(checkpoint_dir, f"iter_{iteration:07d}", "run_config.yaml"))
    allow_in_run_config()  # a fresh process: configure() has not run yet
    return instantiate(OmegaConf.to_container(saved.model.transformer_layer_spec, resolve=True))


def _log(run: str, losses: list[float]) -> None:
    """Append the run's losses to the JSON-lines file ``$LONGCTX_LOSS_LOG`` names, if any (the loss table)."""
    path = os.environ.get("LONGCTX_LOSS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"run": run, "losses": losses}) + "\n")


@pytest.fixture(scope="module")
def cp1_losses():
    first, second = run_ranks(2, _train, 1)
    assert first == second and len(first) == STEPS
    _log("bridge vanilla_gpt CP=1", first)
    return first


@pytest.mark.parametrize("algorithm", ["ring", "allgather", "ulysses"])
def test_context_parallel_losses_equal_cp1(cp1_losses, algorithm):
    first, second = run_ranks(2, _train, 2, cp_algorithm=algorithm)
    _log(f"bridge vanilla_gpt CP=2 {algorithm}", first)
    assert first == second == pytest.approx(cp1_losses, rel=1e-5)
    assert cp1_losses[-1] < cp1_losses[0]  # it trains


def test_memory_features_keep_the_losses(cp1_losses):
    first, second = run_ranks(2, _train, 2, cp_algorithm="ring", offload_policy="layers", tiled_mlp_tiles=2,
                              tiled_loss_tiles=2)
    _log("bridge vanilla_gpt CP=2 ring + layer offload, tiled MLP, tiled loss", first)
    assert first == second == pytest.approx(cp1_losses, rel=1e-5)


def test_model_state_offload_host_keeps_the_losses(cp1_losses):
    """Bridge's loop with the weights and gradients streamed per layer from host memory (installed when
    Bridge builds its optimizer): two streamed runs equal to the bit; the same CP=2 ring run without it to
    float32's rounding (measured on the 2-core machine: step 1's gradients one rounding step apart in every
    parameter, the same sums through other buffers; losses equal for two steps, 2.5e-8 relative at the
    third); with the recipe's clipping (1.0), the losses of CP=1 as every CP=2 run here."""
    plain, _ = run_ranks(2, _train, 2, clip_grad=0.0, cp_algorithm="ring")
    first, second = run_ranks(2, _train, 2, clip_grad=0.0, cp_algorithm="ring", model_state_offload="host")
    assert first == second
    assert first == pytest.approx(plain, rel=1e-6, abs=0)
    clipped, _ = run_ranks(2, _train, 2, cp_algorithm="ring", model_state_offload="host")
    _log("bridge vanilla_gpt CP=2 ring + model-state offload host", clipped)
    assert clipped == pytest.approx(cp1_losses, rel=1e-5)


def test_model_state_offload_disk_equals_host_and_resumes_bit_for_bit(tmp_path):
    """Bridge's loop with the weights, gradients and Adam moments in files: the losses of the same run streamed
    from host memory, to the bit; 2 steps saved (Bridge's checkpointing reads every unit back from its files)
    and 2 more resumed (the weights written back to new files) continue the 4 steps straight, to the bit."""
    host, _ = run_ranks(2, _train, 2, 4, clip_grad=0.0, cp_algorithm="ring", model_state_offload="host")
    options = {"cp_algorithm": "ring", "model_state_offload": "disk", "offload_disk_dir": str(tmp_path / "states")}
    straight, _ = run_ranks(2, _train, 2, 4, clip_grad=0.0, **options)
    _log("bridge vanilla_gpt CP=2 ring + model-state offload disk", straight)
    assert straight == host
    first, _ = run_ranks(2, _train, 2, 4, save_at=2, save=str(tmp_path / "ckpt"), clip_grad=0.0, **options)
    resumed, again = run_ranks(2, _train, 2, 4, resume=str(tmp_path / "ckpt"), clip_grad=0.0)
    assert first == straight[:2]
    assert resumed == again == straight[2:]


@pytest.mark.parametrize("target", ["host", "disk"])
def test_model_state_offload_with_the_distributed_optimizer(target, tmp_path):
    """The recipe's distributed optimizer beside the offload: configure hands it to the plugin, which keeps each
    rank's half of Adam's moments (CP=2: two data x context parallel ranks) and gathers the updated halves.
    Four steps equal the same run without it to the bit, and two saved and two resumed continue them."""
    options = {"cp_algorithm": "ring", "model_state_offload": target}
    if target == "disk":
        options["offload_disk_dir"] = str(tmp_path / "states")
    whole, _ = run_ranks(2, _train, 2, 4, clip_grad=0.0, **options)
    sharded, _ = run_ranks(2, _train, 2, 4, clip_grad=0.0, distributed_optimizer=True, **options)
    assert sharded == whole
    first, _ = run_ranks(2, _train, 2, 4, save_at=2, save=str(tmp_path / "ckpt"), clip_grad=0.0,
                         distributed_optimizer=True, **options)
    resumed, again = run_ranks(2, _train, 2, 4, resume=str(tmp_path / "ckpt"), clip_grad=0.0)
    assert first == whole[:2]
    assert resumed == again == whole[2:]


def test_save_and_resume_from_run_config_continue_bit_for_bit(tmp_path):
    """4 steps straight, against 2 steps saved and 2 more resumed from the checkpoint's run_config.yaml (CP=2
    ring with the tiled MLP and loss: the spec object and its options come back from the YAML)."""
    options = {"cp_algorithm": "ring", "tiled_mlp_tiles": 2, "tiled_loss_tiles": 2}
    straight, _ = run_ranks(2, _train, 2, 4, **options)
    first, _ = run_ranks(2, _train, 2, 4, save_at=2, save=str(tmp_path), **options)
    resumed, again = run_ranks(2, _train, 2, 4, resume=str(tmp_path))
    _log("bridge vanilla_gpt CP=2 ring, tiled MLP and loss: 4 steps straight", straight)
    _log("bridge vanilla_gpt CP=2 ring, tiled MLP and loss: 2 steps, saved, resumed for 2", first + resumed)
    assert first == straight[:2]
    assert resumed == again == straight[2:]  # bit for bit
    from megatron_longctx.bridge import LongContextLayerSpec

    spec = _saved_layer_spec(str(tmp_path))  # what the resumed run built its layers from
    assert isinstance(spec, LongContextLayerSpec) and spec.options == options
