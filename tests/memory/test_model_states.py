"""Model-state streaming: weights into device slots per unit, gradients out to the off-device accumulator.

Outputs and gradients equal the run without streaming (float32: bit for bit), with and without recompute,
over several micro-batches; the bytes in device slots never exceed the slots, and no unit's weights stay in
a slot after its use.
"""

from __future__ import annotations

import copy
import errno
import os
import resource

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils.checkpoint import checkpoint

from megatron_longctx.memory import hooks
from megatron_longctx.memory.host_pool import HostPool
from megatron_longctx.memory.model_states import ModelStateError, ModelStateStreamer, StreamOptions


class Block(torch.nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(h)
        self.fc1 = torch.nn.Linear(h, 2 * h)
        self.fc2 = torch.nn.Linear(2 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Stack(torch.nn.Module):
    def __init__(self, h: int = 16, n: int = 4, vocab: int = 32, recompute: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, h)
        self.blocks = torch.nn.ModuleList(Block(h) for _ in range(n))
        self.head = torch.nn.Linear(h, vocab, bias=False)
        self.recompute = recompute

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.recompute else b(x)
        return self.head(x)

    def units(self) -> list:
        return [self.embed, *self.blocks, self.head]


def _streamer(model: Stack, target: str, tmp_path, pool_bytes: int = 1 << 24) -> ModelStateStreamer:
    opts = StreamOptions(target=target, device=torch.device("cpu"), pool=HostPool(pool_bytes, pin=False),
                         disk_dir=str(tmp_path) if target == "disk" else None)
    return ModelStateStreamer(model.units(), opts)


def _loss(model: Stack, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))


@pytest.mark.parametrize("target", ["host", "disk"])
@pytest.mark.parametrize("recompute", [False, True])
def test_outputs_and_grads_bit_for_bit(target: str, recompute: bool, tmp_path) -> None:
    torch.manual_seed(0)
    ref = Stack(recompute=recompute)
    model = copy.deepcopy(ref)
    streamer = _streamer(model, target, tmp_path)
    batches = [torch.randint(0, 32, (2, 8)) for _ in range(3)]  # three micro-batches, accumulated
    for tokens in batches:
        want = _loss(ref, tokens)
        want.backward()
        got = _loss(model, tokens)
        assert_close(got, want, rtol=0, atol=0)
        got.backward()
        streamer.finish_backward()
        streamer.check_released()
    for i, unit in enumerate(ref.units()):
        for p_ref, w, g in zip(unit.parameters(), streamer.unit_weights(i), streamer.unit_grads(i)):
            assert_close(w, p_ref.detach(), rtol=0, atol=0)
            assert_close(g, p_ref.grad, rtol=0, atol=0)
    streamer.remove()


@pytest.mark.parametrize("target", ["host", "disk"])
def test_scale_grads_scales_the_accumulators(target: str, tmp_path) -> None:
    """Megatron's ``scale_gradients`` (per-token loss) reaches the off-device accumulators."""
    torch.manual_seed(0)
    ref = Stack()
    model = copy.deepcopy(ref)
    streamer = _streamer(model, target, tmp_path)
    tokens = torch.randint(0, 32, (2, 8))
    _loss(ref, tokens).backward()
    _loss(model, tokens).backward()
    streamer.finish_backward()
    streamer.scale_grads(0.25)
    for i, unit in enumerate(ref.units()):
        for p_ref, g in zip(unit.parameters(), streamer.unit_grads(i)):
            assert_close(g, p_ref.grad * 0.25, rtol=0, atol=0)
    streamer.remove()


def test_float64_reference(tmp_path) -> None:
    """Against a float64 run of the same model (tolerance of float32)."""
    torch.manual_seed(1)
    model = Stack(recompute=True)
    ref = copy.deepcopy(model).double()
    streamer = _streamer(model, "host", tmp_path)
    tokens = torch.randint(0, 32, (2, 8))
    _loss(ref, tokens).backward()
    _loss(model, tokens).backward()
    streamer.finish_backward()
    for i, unit in enumerate(ref.units()):
        for p_ref, g in zip(unit.parameters(), streamer.unit_grads(i)):
            assert_close(g.double(), p_ref.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("recompute", [False, True])
def test_device_slots_bound_and_release(recompute: bool, tmp_path) -> None:
    """The slot bytes never exceed the slots, and a unit's weights leave its slot after its forward."""
    torch.manual_seed(0)
    model = Stack(recompute=recompute, n=5)
    streamer = _streamer(model, "host", tmp_path)
    seen: list = []
    slot_ptrs = {s.untyped_storage().data_ptr() for s in streamer.wslots}

    def after(module, *_):  # runs after the streamer's own forward post-hook
        seen.append(streamer.resident)
        assert streamer.resident <= streamer.capacity
        if torch.is_grad_enabled() and not torch._C._current_graph_task_id() >= 0:  # plain forward, not recompute
            for p in module.parameters():
                assert p.data.untyped_storage().data_ptr() not in slot_ptrs, "weights stayed in a slot after use"

    for unit in model.units():
        unit.register_forward_hook(after)
    _loss(model, torch.randint(0, 32, (2, 8))).backward()
    streamer.finish_backward()
    streamer.check_released()
    assert streamer.peak_resident <= streamer.capacity
    # the slots hold two units, not the whole model: less than half the model's parameter + gradient bytes
    total = sum(p.numel() * 8 for p in model.parameters())
    assert streamer.capacity < total / 2
    # each unit comes in twice: forward, and backward (a recompute runs inside the backward's stay)
    assert streamer.loads == 2 * len(model.units())
    assert streamer.grad_flushes == len(model.units())


def test_next_unit_comes_in_ahead_of_its_use(tmp_path) -> None:
    """``host``: each pass brings the next unit in while the current one is in use (forward upwards,
    backward downwards), so every unit but each pass's first is already in a slot when its hook runs, and
    no copy is wasted: two loads per unit, as without the prefetch."""
    torch.manual_seed(0)
    model = Stack(n=5)
    streamer = _streamer(model, "host", tmp_path)
    ahead: list = []
    for i, unit in enumerate(model.units()):
        unit.register_forward_pre_hook(lambda _m, _a, i=i: ahead.append(streamer.units[i].wslot is not None),
                                       prepend=True)  # before the streamer's own
    _loss(model, torch.randint(0, 32, (2, 8))).backward()
    streamer.finish_backward()
    streamer.check_released()
    n = len(streamer.units)
    assert ahead == [False] + [True] * (n - 1)
    assert streamer.loads == 2 * n and streamer.prefetches == 2 * (n - 1)


class GroupedStack(Stack):
    """Megatron's ``--recompute-method uniform --recompute-num-layers 3``: blocks checkpointed three at a
    time with the reentrant checkpoint (forward without grad, recomputed inside backward)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        blocks = list(self.blocks)
        for start in range(0, len(blocks), 3):
            group = blocks[start:start + 3]
            x = checkpoint(lambda y, g=group: _run(g, y), x, use_reentrant=True)
        return self.head(x)


def _run(blocks, x: torch.Tensor) -> torch.Tensor:
    for b in blocks:
        x = b(x)
    return x


def test_recompute_of_several_units_in_two_slots(tmp_path) -> None:
    """A recompute inside backward walks three units upwards while two slots hold the weights: a unit kept
    for its coming backward gives its slot up when a load needs it, and the gradients stay bit for bit."""
    torch.manual_seed(0)
    ref = GroupedStack(n=6)
    model = copy.deepcopy(ref)
    streamer = _streamer(model, "host", tmp_path)
    for tokens in [torch.randint(0, 32, (2, 8)) for _ in range(2)]:
        _loss(ref, tokens).backward()
        _loss(model, tokens).backward()
        streamer.finish_backward()
        streamer.check_released()
        assert streamer.peak_resident <= streamer.capacity
    assert streamer.evictions > 0  # a kept unit gave its slot up to a load
    for i, unit in enumerate(ref.units()):
        for p_ref, g in zip(unit.parameters(), streamer.unit_grads(i)):
            assert_close(g, p_ref.grad, rtol=0, atol=0)
    streamer.remove()


class _FusedWgrad(torch.autograd.Function):
    """``x @ w.t()`` whose backward adds ``dW`` into ``w.main_grad`` itself and hands autograd an unread
    placeholder (NaN here) with ``grad_added_to_main_grad`` set: Megatron's gradient-accumulation fusion."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        ctx.weight = w  # the parameter: its main_grad is looked up in backward
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):
        (x,), w = ctx.saved_tensors, ctx.weight
        w.main_grad.add_(dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))
        w.grad_added_to_main_grad = True
        return dy @ w, torch.full_like(w, float("nan"))


class FusedHead(torch.nn.Module):
    def __init__(self, h: int, vocab: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, h) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FusedWgrad.apply(x, self.weight)


def test_gradient_accumulation_fusion_protocol(tmp_path) -> None:
    """A backward that adds into ``main_grad`` itself (the placeholder it returns is NaN): the accumulator
    holds exactly the gradients, over two micro-batches, and ``zero_grad`` resets the protocol's flag."""
    torch.manual_seed(0)
    ref = Stack(n=2)
    model = copy.deepcopy(ref)
    model.head = FusedHead(16, 32)
    with torch.no_grad():
        model.head.weight.copy_(ref.head.weight)
    streamer = _streamer(model, "host", tmp_path)
    for tokens in [torch.randint(0, 32, (2, 8)) for _ in range(2)]:
        _loss(ref, tokens).backward()
        _loss(model, tokens).backward()
        streamer.finish_backward()
    for i, unit in enumerate(ref.units()):
        for p_ref, g in zip(unit.parameters(), streamer.unit_grads(i)):
            assert_close(g, p_ref.grad, rtol=1e-6, atol=1e-7)
    assert model.head.weight.grad_added_to_main_grad
    streamer.zero_grad()
    assert not model.head.weight.grad_added_to_main_grad
    streamer.remove()


def test_check_released_fails_when_weights_stay(tmp_path) -> None:
    torch.manual_seed(0)
    model = Stack()
    streamer = _streamer(model, "host", tmp_path)
    streamer._pre_forward(streamer.units[1])  # a forward that never finished: its weights stay in the slot
    with pytest.raises(AssertionError, match=r"units \[1, 2\] still hold device slots"):  # 2: its prefetch
        streamer.check_released()
    streamer.remove()
    assert not hooks._packers(), "remove() leaves no packer registered"


def test_host_pool_too_small_is_refused(tmp_path) -> None:
    model = Stack()
    with pytest.raises(ModelStateError, match=r"--longctx-model-state-offload host.*bytes.*"
                                              r"--longctx-offload-host-pool-bytes"):
        _streamer(model, "host", tmp_path, pool_bytes=4096)


def test_disk_full_while_gradients_are_written(tmp_path) -> None:
    """The file-size limit is hit while a gradient accumulator is written: one error naming the flag,
    the file and the bytes."""
    torch.manual_seed(0)
    model = Stack()
    streamer = _streamer(model, "disk", tmp_path)
    limit = min(u.gbytes for u in streamer.units) - 1  # every gradient file is larger
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    import signal
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(ModelStateError) as err:
            _loss(model, torch.randint(0, 32, (2, 8))).backward()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    msg = str(err.value)
    assert "--longctx-model-state-offload disk" in msg and "gradients" in msg and "bytes" in msg
    assert str(tmp_path) in msg and errno.errorcode[errno.EFBIG] in msg
    streamer.remove()


# ------------------------------------------------------------------ through Megatron's GPTModel (one rank)
def _same_losses(ref, model, b: dict, tokens: torch.Tensor) -> None:
    """A micro-batch's forward and backward through ``ref`` and the streamed ``model``: the same loss."""
    losses = []
    for m in (ref, model):
        torch.manual_seed(7)
        per_token = m(b["tokens"], b["position_ids"], None, labels=b["labels"])
        loss = (per_token.float() * b["loss_mask"]).sum() / tokens
        loss.backward()
        losses.append(loss.detach())
    assert_close(losses[1], losses[0], rtol=0, atol=0)


def _gpt_body(recompute: bool, target: str, disk_dir: str, loss_tiles: int = 1) -> None:
    import warnings

    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.dist import megatron_parallel
    from tests.gpt_kit import SEQ, VOCAB, batch, cpu, local_spec, tiny_config

    extra = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} \
        if recompute else {}
    with cpu(), megatron_parallel():
        def build():
            torch.manual_seed(3)
            model_parallel_cuda_manual_seed(3)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return GPTModel(tiny_config(num_layers=3, **extra), local_spec(), vocab_size=VOCAB,
                                max_sequence_length=SEQ, position_embedding_type="rope",
                                share_embeddings_and_output_weights=False)

        ref, model = build(), build()
        if loss_tiles > 1:  # the loss runs inside the output layer's call, where its weights are in a slot
            from megatron_longctx.megatron.tiled_loss import install_tiled_loss

            install_tiled_loss(ref, loss_tiles)
            install_tiled_loss(model, loss_tiles)
        units = [model.embedding, *model.decoder.layers, model.output_layer]
        opts = StreamOptions(target=target, device=torch.device("cpu"), pool=HostPool(1 << 24, pin=False),
                             disk_dir=disk_dir if target == "disk" else None)
        streamer = ModelStateStreamer(units, opts)
        peak = 0
        for step in range(2):  # two micro-batches, accumulated
            b = batch(seed=step)
            _same_losses(ref, model, b, b["loss_mask"].sum())
            streamer.finish_backward()
            streamer.check_released()
            peak = max(peak, streamer.peak_resident)
        assert 0 < peak <= streamer.capacity
        assert streamer.loads >= 2 * 2 * len(units) and streamer.grad_flushes == 2 * len(units)
        ref_units = [ref.embedding, *ref.decoder.layers, ref.output_layer]
        for i, unit in enumerate(ref_units):
            for p_ref, w, g in zip(unit.parameters(), streamer.unit_weights(i), streamer.unit_grads(i)):
                assert_close(w, p_ref.detach(), rtol=0, atol=0)
                assert_close(g, p_ref.grad, rtol=0, atol=0)
        for (name, p_ref), p in zip(ref.decoder.final_layernorm.named_parameters(),
                                    model.decoder.final_layernorm.parameters()):  # not streamed: as before
            assert_close(p.grad, p_ref.grad, rtol=0, atol=0)
        streamer.remove()


@pytest.mark.parametrize("recompute,target,loss_tiles", [(False, "host", 1), (True, "disk", 1), (True, "disk", 3)])
def test_megatron_gpt_bit_for_bit(recompute: bool, target: str, loss_tiles: int, tmp_path) -> None:
    from tests.dist import run_ranks

    run_ranks(1, _gpt_body, recompute, target, str(tmp_path), loss_tiles)


# ------------------------------------------------------------------ flags and bad input
def _args(*argv: str):
    import argparse

    from megatron_longctx.megatron.arguments import add_longctx_args

    return add_longctx_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_flag_parses_into_its_section(tmp_path) -> None:
    from megatron_longctx.megatron.arguments import check_after_parsing

    args = _args("--longctx-model-state-offload", "disk", "--longctx-offload-disk-dir", str(tmp_path))
    cfg = check_after_parsing(args)
    assert cfg.model_states.model_state_offload == "disk" and cfg.model_states.enabled
    assert cfg.memory.offload_disk_dir == str(tmp_path)


def test_bad_input_names_the_flags_and_the_fix(tmp_path) -> None:
    from megatron_longctx.config import LongContextConfig, ModelStateConfig
    from megatron_longctx.megatron.arguments import check_after_parsing

    with pytest.raises(ValueError, match=r"--longctx-model-state-offload: got 'gpu'; choose one of none, host, disk"):
        ModelStateConfig(model_state_offload="gpu")
    with pytest.raises(ValueError, match=r"--longctx-model-state-slots: got 1; give an integer >= 2"):
        ModelStateConfig(model_state_slots=1)
    with pytest.raises(ValueError, match=r"--longctx-offload-disk-dir: is only used with .*model-state-offload disk"):
        LongContextConfig.from_flat({"offload_disk_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=r"--longctx-model-state-offload: 'host' does not go with "
                                         r"--longctx-tiled-loss-recompute: .*drop --longctx-tiled-loss-recompute"):
        LongContextConfig.from_flat({"model_state_offload": "host", "tiled_loss_tiles": 4, "tiled_loss_recompute": True})
    LongContextConfig.from_flat({"model_state_offload": "host", "tiled_loss_tiles": 4})  # the tiled loss goes with it
    for megatron in ({"cpu_offloading": True}, {"cpu_offloading_num_layers": 2}, {"cpu_offloading_weights": True}):
        args = _args("--longctx-model-state-offload", "host")
        vars(args).update(megatron)
        flag = "--" + next(iter(megatron)).replace("_", "-")
        with pytest.raises(ValueError, match=rf"--longctx-model-state-offload: Megatron's {flag} .*drop {flag}"):
            check_after_parsing(args)
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    if os.access(locked, os.W_OK):  # root ignores the mode: a file in the way stands for the unwritable directory
        locked = tmp_path / "file"
        locked.write_text("")
    with pytest.raises(ValueError, match=rf"--longctx-model-state-offload disk: --longctx-offload-disk-dir {locked} "
                                         r"is not writable .*give a directory this user can write"):
        check_after_parsing(_args("--longctx-model-state-offload", "disk", "--longctx-offload-disk-dir", str(locked)))
    # a pool too small for two layer slots: refused with the bytes it needs
    args = _args("--longctx-model-state-offload", "host", "--longctx-offload-host-pool-bytes", str(1 << 20))
    vars(args).update(hidden_size=1536, ffn_hidden_size=4096, num_attention_heads=12, group_query_attention=True,
                      num_query_groups=4, swiglu=True, bf16=True)
    per_layer = 1536 * (1536 + 2 * 4 * 128) + 1536 * 1536 + 3 * 1536 * 4096 + 2 * 1536
    with pytest.raises(ValueError, match=rf"--longctx-offload-host-pool-bytes {1 << 20} cannot hold two layer slots "
                                         rf"\({2 * per_layer * 6} bytes.*raise it to at least {2 * per_layer * 6}"):
        check_after_parsing(args)


# ------------------------------------------------------------------ context parallelism (two ranks)
def _cp_body(algorithm: str, recompute: bool) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_longctx import apply_to_spec
    from megatron_longctx.megatron.batch import get_batch_on_this_cp_rank
    from tests.dist import megatron_parallel
    from tests.gpt_kit import batch, build_gpt, cpu, local_spec, tiny_config

    extra = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} \
        if recompute else {}
    with cpu(), megatron_parallel(cp=2):
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)

        def build():
            return build_gpt(tiny_config(cp=2, **extra), apply_to_spec(local_spec(), cp_algorithm=algorithm))

        ref, model = build(), build()
        units = [model.embedding, *model.decoder.layers, model.output_layer]
        opts = StreamOptions(target="host", device=torch.device("cpu"), pool=HostPool(1 << 24, pin=False),
                             reduce_group=group)
        streamer = ModelStateStreamer(units, opts)
        cp_group = parallel_state.get_context_parallel_group()
        for step in range(2):  # two micro-batches; the gradients are reduced once, after the last (as DDP's)
            streamer.sync_grads = step == 1
            full = batch(seed=step)
            local = get_batch_on_this_cp_rank(dict(full), cp_group)
            _same_losses(ref, model, local, full["loss_mask"].sum())
            streamer.finish_backward()
            streamer.check_released()
        ref_units = [ref.embedding, *ref.decoder.layers, ref.output_layer]
        for i, unit in enumerate(ref_units):
            for p_ref, w, g in zip(unit.parameters(), streamer.unit_weights(i), streamer.unit_grads(i)):
                dist.all_reduce(p_ref.grad, group=group)
                assert_close(w, p_ref.detach(), rtol=0, atol=0)
                assert_close(g, p_ref.grad, rtol=0, atol=0)
        streamer.remove()


@pytest.mark.parametrize("algorithm,recompute", [("ring", True), ("ulysses", False)])
def test_cp2_bit_for_bit(algorithm: str, recompute: bool) -> None:
    """CP=2 with our attention: the gradient slots summed over the DP x CP group before they leave."""
    from tests.dist import run_ranks

    run_ranks(2, _cp_body, algorithm, recompute)


def test_bridge_refuses_disk_and_training_loops_defer() -> None:
    """Bridge's configure refuses ``disk`` by name (Bridge's checkpointing would not read the files back) and
    Megatron's ``cpu_offloading`` beside the flag; the installer defers the install to the optimizer's build
    (after DDP), patching ``get_megatron_optimizer`` of Megatron-LM's loop and, once Bridge's optimizer module
    is imported, of Bridge's, each once."""
    import sys
    import types

    training = pytest.importorskip("megatron.training.training", reason="the deferred install patches megatron.training")

    from megatron_longctx.bridge.configure import check_model_config, check_model_state_training
    from megatron_longctx.config import LongContextConfig
    from megatron_longctx.megatron.features.base import Built
    from megatron_longctx.megatron.features.model_states import BRIDGE_OPTIMIZER_MODULES, FEATURE
    from megatron_longctx.megatron.memory_spec import install_and_report

    disk = LongContextConfig.from_flat({"model_state_offload": "disk"})
    with pytest.raises(ValueError, match=r"model_state_offload='disk'.*use model_state_offload='host'"):
        check_model_config(types.SimpleNamespace(), disk)
    host = LongContextConfig.from_flat({"model_state_offload": "host"})
    with pytest.raises(ValueError, match=r"model.cpu_offloading.*set model.cpu_offloading=false"):
        check_model_config(types.SimpleNamespace(cpu_offloading=True), host)
    check_model_config(types.SimpleNamespace(), host)  # host goes through Bridge
    with pytest.raises(ValueError, match=r"model.gradient_accumulation_fusion.*set model.gradient_accumulation_fusion=false"):
        check_model_config(types.SimpleNamespace(gradient_accumulation_fusion=True), host)
    fused = torch.nn.Linear(2, 2)
    fused.config = types.SimpleNamespace(gradient_accumulation_fusion=True)  # Megatron's, with apex's kernel
    with pytest.raises(ValueError, match=r"--longctx-model-state-offload: .*add --no-gradient-accumulation-fusion"):
        FEATURE.install(Built.of(fused), host)
    recipe = types.SimpleNamespace(ddp=types.SimpleNamespace(use_distributed_optimizer=True),
                                   optimizer=types.SimpleNamespace(use_distributed_optimizer=True))
    with pytest.raises(ValueError, match=r"ddp.use_distributed_optimizer=True.*set ddp.use_distributed_optimizer=false"):
        check_model_state_training(recipe)
    recipe.ddp.use_distributed_optimizer = recipe.optimizer.use_distributed_optimizer = False
    check_model_state_training(recipe)

    bridge_optim = types.ModuleType(BRIDGE_OPTIMIZER_MODULES[0])  # Bridge's module, as its loop imports it
    bridge_optim.get_megatron_optimizer = bridge_original = lambda *a, **k: None
    original = training.get_megatron_optimizer
    sys.modules[bridge_optim.__name__] = bridge_optim
    try:
        assert install_and_report(torch.nn.Linear(2, 2), host) is None
        assert training.get_megatron_optimizer is not original
        assert bridge_optim.get_megatron_optimizer is not bridge_original
    finally:
        for pending in FEATURE.pending:
            pending.undo()
        del sys.modules[bridge_optim.__name__]
    assert training.get_megatron_optimizer is original and bridge_optim.get_megatron_optimizer is bridge_original
