"""Model-state streaming through Megatron: GPTModel on one rank and at CP=2 equal to the run without it
bit for bit (host and disk, with recompute and the tiled loss), the flag parsed into its section, bad input
refused naming the flags, Bridge's configuration and the training loops' deferred install."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from megatron_longctx.memory.host_pool import HostPool
from megatron_longctx.memory.model_states import ModelStateStreamer, StreamOptions



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


def _seeded_gpt(spec: Any = None, **config: Any) -> Any:
    """A 3-layer GPTModel (``spec``, else Megatron's local spec; RoPE, untied), the same weights on every call."""
    import warnings

    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tests.gpt_kit import SEQ, VOCAB, local_spec, tiny_config

    torch.manual_seed(3)
    model_parallel_cuda_manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(tiny_config(num_layers=3, **config), spec or local_spec(), vocab_size=VOCAB,
                        max_sequence_length=SEQ, position_embedding_type="rope",
                        share_embeddings_and_output_weights=False)


def _gpt_body(recompute: bool, target: str, disk_dir: str, loss_tiles: int = 1, loss_recompute: bool = False) -> None:
    from tests.dist import megatron_parallel
    from tests.gpt_kit import batch, cpu
    from tests.memory.test_model_states import same_states

    extra = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1} \
        if recompute else {}
    with cpu(), megatron_parallel():
        ref, model = _seeded_gpt(**extra), _seeded_gpt(**extra)
        if loss_tiles > 1:  # the loss runs inside the output layer's call, where its weights are in a slot
            from megatron_longctx.megatron.tiled_loss import install_tiled_loss

            install_tiled_loss(ref, loss_tiles, loss_recompute)
            install_tiled_loss(model, loss_tiles, loss_recompute)
        from megatron_longctx.megatron.features.model_states import _units

        # the units the installer streams; with the loss's recompute the final norm rides in the output's unit
        units, ref_units = (_units(m, norm_with_output=loss_recompute) for m in (model, ref))
        assert len(units) == len(model.decoder.layers) + (2 if loss_recompute else 3)
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
        assert streamer.loads >= 2 * 2 * len(units) and streamer.grad_flushes == 2 * len(units), \
            (streamer.loads, streamer.grad_flushes, len(units))
        same_states(ref_units, streamer)
        streamer.remove()


@pytest.mark.parametrize("recompute,target,loss_tiles,loss_recompute",
                         [(False, "host", 1, False), (True, "disk", 1, False), (True, "disk", 3, False),
                          (True, "disk", 3, True), (False, "host", 3, True)])
def test_megatron_gpt_bit_for_bit(recompute: bool, target: str, loss_tiles: int, loss_recompute: bool,
                                  tmp_path) -> None:
    from tests.dist import run_ranks

    run_ranks(1, _gpt_body, recompute, target, str(tmp_path), loss_tiles, loss_recompute)


def _built_on_disk_body(disk_dir: str) -> None:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_longctx.config import LongContextConfig
    from megatron_longctx.megatron.features.base import Built
    from megatron_longctx.megatron.features.model_states import FEATURE, _units
    from megatron_longctx.memory.model_state_store import STASHED
    from tests.dist import megatron_parallel
    from tests.gpt_kit import batch, cpu, local_spec
    from tests.memory.test_model_states import same_states

    cfg = LongContextConfig.from_flat({"model_state_offload": "disk", "offload_disk_dir": disk_dir})
    with cpu(), megatron_parallel():
        ref = _seeded_gpt()
        model = _seeded_gpt(FEATURE.spec(local_spec(), cfg))
        # every layer's weights went to their file as it was built: no layer holds them in memory
        files = []
        for layer in model.decoder.layers:
            stashed = getattr(layer, STASHED)
            assert os.path.getsize(stashed.path) == stashed.nbytes > 0
            assert all(p.untyped_storage().nbytes() == p.element_size() for p in layer.parameters())
            files.append(stashed.path)
        assert len(set(files)) == len(model.decoder.layers)
        assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in model.embedding.parameters())

        with FEATURE.wrapping_ddp(model, cfg):
            ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        assert ddp.buffers and all(b.grad_data.is_meta for b in ddp.buffers)  # laid out, no memory behind them
        installed = FEATURE.install(Built.of([ddp]), cfg)
        streamer = installed.streamer
        assert all(b.grad_data is None for b in ddp.buffers)
        assert not any(os.path.exists(f) for f in files) and not os.path.exists(os.path.dirname(files[0]))
        for step in range(2):  # two micro-batches, accumulated
            b = batch(seed=step)
            _same_losses(ref, ddp, b, b["loss_mask"].sum())
            ddp.finish_grad_sync()
            streamer.check_released()
        same_states(_units(ref), streamer)
        for undo_patch in reversed(installed.patches):
            undo_patch()
        streamer.remove()


def test_disk_builds_each_layer_into_its_file_and_ddp_buffers_hold_nothing(tmp_path) -> None:
    """With ``disk`` a model is never whole in memory: each layer's weights are written to their file as Megatron
    builds the layer, DDP's gradient buffers are laid out without memory, and the streamer takes the files as
    its units' own; two micro-batches then equal the model built and trained without it, bit for bit."""
    from tests.dist import run_ranks

    run_ranks(1, _built_on_disk_body, str(tmp_path))


def test_a_spec_stashed_twice_builds_layers_that_stash_once(tmp_path) -> None:
    """The spec edit of ``disk`` applied to its own output (a spec passed through the plugin twice) gives the
    same layer class, one stash per built layer, not a subclass that would write each layer twice."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_longctx.config import LongContextConfig
    from megatron_longctx.megatron.features.model_states import FEATURE
    from tests.gpt_kit import local_spec

    cfg = LongContextConfig.from_flat({"model_state_offload": "disk", "offload_disk_dir": str(tmp_path)})
    once = FEATURE.spec(local_spec(), cfg)
    twice = FEATURE.spec(once, cfg)
    assert once.module is twice.module and once.module.__mro__[1] is TransformerLayer
    assert "longctx_stash" in twice.params and local_spec().module is TransformerLayer  # the original untouched


def _bf16_body(root: str, disk: bool) -> tuple:
    """Three bf16 steps of the benchmark's Trainer (Megatron's Float16Module, DDP and mixed-precision optimizer,
    clipping on) at CP=2 ring, with the model states on disk or not: the losses, gradient norms, and each unit's
    bf16 weights and float32 masters at the end."""
    from megatron.core import parallel_state

    from megatron_longctx.bench.engine import GPTShape, OptimConfig, Trainer, Variant
    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.megatron.features.base import unwrap
    from megatron_longctx.megatron.features.model_states import _units
    from megatron_longctx.megatron.offdevice_optimizer import megatron_optimizers
    from megatron_longctx.memory.model_state_store import is_placeholder
    from tests.megatron.test_offdevice_optimizer import SEQ, SMALL, _batches

    options = (("cp_algorithm", "ring"),) + (
        (("model_state_offload", "disk"), ("offload_disk_dir", root)) if disk else ())
    with cpu_compat.enabled():
        trainer = Trainer(GPTShape(SMALL, seq_length=SEQ, bf16=True),
                          Variant("p", context_parallel_size=2, plugin=True, longctx_options=options),
                          OptimConfig(weight_decay=0.1, clip_grad=0.05), 2, 1)
        in_units = [p for unit in _units(unwrap(trainer.ddp)[0])
                    for p in (q for m in (unit if isinstance(unit, tuple) else (unit,)) for q in m.parameters())]
        start = [] if disk else [p.main_param.detach().clone() for p in in_units]
        kinds = [type(w).__name__ for w in megatron_optimizers(trainer.optimizer)]
        inner = [type(w.optimizer).__name__ for w in megatron_optimizers(trainer.optimizer)]
        in_step: list[str] = []  # what the optimizer step reads, unit by unit
        if disk:
            store = trainer.model_states.streamer
            read_into, masters_in = store._read_into, store.masters_in

            def recorded_read(buf, path, nbytes, what):
                in_step.extend([what] if store._stepping else [])
                return read_into(buf, path, nbytes, what)

            @contextlib.contextmanager
            def recorded_masters(index):
                store._stepping = True
                try:
                    with masters_in(index) as pairs:
                        store._stepping = False
                        yield pairs
                finally:
                    store._stepping = False

            store._stepping = False
            store._read_into, store.masters_in = recorded_read, recorded_masters
        steps = [trainer.step(i, b) for i, b in enumerate(_batches())]
        weights, masters = [], []
        if disk:
            streamer = trainer.model_states.streamer
            # every parameter of a unit has a master: the step reads the masters only, never the bf16 weights
            units = len(streamer.units)
            assert in_step == [f"unit {i}'s master weights" for _ in steps for i in range(units)], in_step
            assert streamer.opts.masters and all(u.mpath for u in streamer.units)
            # the optimizer's masters hold no values between steps: they are in the files
            assert all(is_placeholder(p.param.main_param) for u in streamer.units for p in u.params)
            for i in range(len(streamer.units)):
                weights += streamer.unit_weights(i)
                masters += streamer.unit_masters(i)
        else:
            weights = [p.detach().clone() for p in in_units]
            masters = [p.main_param.detach().clone() for p in in_units]
        trainer.close()
        parallel_state.destroy_model_parallel()
    return [s.loss for s in steps], [s.grad_norm for s in steps], weights, masters, kinds, inner, start


def test_disk_under_bf16_keeps_float32_masters_on_disk_and_trains_as_megatron(tmp_path) -> None:
    """bf16 with ``disk``: Megatron's mixed-precision optimizer, its float32 master of each weight a file beside
    the bf16 weights (the optimizer holds placeholders), stepped unit by unit by the off-device AdamW: three
    clipped steps at CP=2 give the losses, gradient norms and bf16 weights of the run without the offload bit
    for bit, and its float32 masters to float32's rounding (measured: one element of one master one rounding
    step apart; the gradients are the same sums through other buffers, as in float32)."""
    from tests.dist import run_ranks
    from tests.megatron.test_offdevice_optimizer import _clipping_runs_on_a_cpu

    if not _clipping_runs_on_a_cpu():
        pytest.skip("megatron-core 0.16's gradient clipping asserts CUDA tensors on a CPU")
    ref = run_ranks(2, _bf16_body, str(tmp_path / "none"), False)[0]
    got = run_ranks(2, _bf16_body, str(tmp_path / "disk"), True)[0]
    assert ref[4] == got[4] == ["Float16OptimizerWithFloat16Params"] and got[5] == ["OffDeviceAdamW"]
    assert got[0] == ref[0] and got[1] == ref[1]
    assert len(got[2]) == len(ref[2]) and len(got[3]) == len(ref[3])
    moved = 0
    for w, w_ref, m, m_ref, m_start in zip(got[2], ref[2], got[3], ref[3], ref[6]):
        assert w.dtype == torch.bfloat16 and m.dtype == torch.float32
        assert_close(w, w_ref, rtol=0, atol=0)
        assert_close(m, m_ref, rtol=1.3e-6, atol=0)
        moved += not torch.equal(m_ref, m_start)
    assert moved == len(ref[3])  # every master was stepped (not just rounded back from its weight)


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
    for recompute in (False, True):  # the tiled loss goes with it, its recompute too
        LongContextConfig.from_flat({"model_state_offload": "host", "tiled_loss_tiles": 4,
                                     "tiled_loss_recompute": recompute})
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
    # disk steps float32 or bf16 (masters on disk) parameters; fp16's and --loss-scale's scaling is refused
    for extra, flag in (({"fp16": True}, "--fp16"), ({"bf16": True, "loss_scale": 1024.0}, "--loss-scale"),
                        ({"data_parallel_random_init": True}, "--data-parallel-random-init")):
        args = _args("--longctx-model-state-offload", "disk", "--longctx-offload-disk-dir", str(tmp_path))
        vars(args).update(extra)
        with pytest.raises(ValueError, match=rf"--longctx-model-state-offload disk.*{flag}.*--longctx-model-state-offload host"):
            check_after_parsing(args)
    args = _args("--longctx-model-state-offload", "disk", "--longctx-offload-disk-dir", str(tmp_path))
    vars(args).update(bf16=True)
    check_after_parsing(args)
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


def test_bridge_checks_and_training_loops_defer(tmp_path) -> None:
    """Bridge's configure refuses, by name, ``disk`` with fp16 (model, optimizer or mixed_precision; bf16 and
    float32 go) or an unwritable directory, and Megatron's ``cpu_offloading`` beside the flag; the installer defers the install
    to the optimizer's build (after DDP), patching ``get_megatron_optimizer`` of Megatron-LM's loop and, once
    Bridge's optimizer module is imported, of Bridge's, each once."""
    import sys
    import types

    training = pytest.importorskip("megatron.training.training", reason="the deferred install patches megatron.training")

    from megatron_longctx.bridge.configure import check_model_config, check_model_state_training
    from megatron_longctx.config import LongContextConfig
    from megatron_longctx.megatron.features.base import Built
    from megatron_longctx.megatron.features.model_states import BRIDGE_OPTIMIZER_MODULES, FEATURE
    from megatron_longctx.megatron.memory_spec import install_and_report

    disk = LongContextConfig.from_flat({"model_state_offload": "disk", "offload_disk_dir": str(tmp_path)})
    with pytest.raises(ValueError, match=r"model.fp16=True: model_state_offload='disk' steps float32 or bf16 .*set "
                                         r"model.fp16=false .*or use model_state_offload='host'"):
        check_model_config(types.SimpleNamespace(fp16=True), disk)
    check_model_config(types.SimpleNamespace(bf16=True), disk)
    fp32 = types.SimpleNamespace(ddp=types.SimpleNamespace(), optimizer=types.SimpleNamespace(bf16=False),
                                 mixed_precision=None)
    check_model_state_training(fp32, disk)
    check_model_state_training(types.SimpleNamespace(ddp=fp32.ddp, optimizer=types.SimpleNamespace(bf16=True),
                                                     mixed_precision="bf16_mixed"), disk)
    for fp16 in (types.SimpleNamespace(ddp=fp32.ddp, optimizer=types.SimpleNamespace(fp16=True)),
                 types.SimpleNamespace(ddp=fp32.ddp, optimizer=fp32.optimizer, mixed_precision="fp16_mixed")):
        with pytest.raises(ValueError, match=r"model_state_offload='disk' steps float32 or bf16 .*optimizer.fp16=false"):
            check_model_state_training(fp16, disk)
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the directory should be
    unwritable = LongContextConfig.from_flat({"model_state_offload": "disk", "offload_disk_dir": str(blocked)})
    with pytest.raises(ValueError, match=rf"--longctx-offload-disk-dir {blocked} is not writable"):
        check_model_state_training(fp32, unwritable)
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
    recipe = types.SimpleNamespace(ddp=types.SimpleNamespace(overlap_grad_reduce=True),
                                   optimizer=types.SimpleNamespace(use_distributed_optimizer=True))
    with pytest.raises(ValueError, match=r"ddp.overlap_grad_reduce=True.*set ddp.overlap_grad_reduce=false"):
        check_model_state_training(recipe, host)
    recipe.ddp.overlap_grad_reduce = False
    check_model_state_training(recipe, host)  # the distributed optimizer: the plugin runs it (configure)

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
