"""The benchmark's model-state offload rows (``<base>+states-<target>``, ``--longctx-model-state-offload``).

The max-sequence budget of every row holds the model's float32 weights, main gradients and Adam moments: a
probe's base is the resident memory measured before the Trainer builds the model, so a point's peak includes
them.  One real probe job (two gloo ranks under torchrun, RSS tracking live tensors, as the search runs it)
trains Megatron's baseline row, ``ring+offload`` and ``ring+offload+states-disk`` for two steps on a 4-layer
model: the baseline's peak holds all 16 bytes per parameter, the disk row's is lower by most of them, its
optimizer is Megatron's with the off-device AdamW inside, and its losses and gradient norms are those of
``ring+offload`` (the second step's loss shows the update).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_longctx.bench import regression
from megatron_longctx.bench.configs import (FLASH_RECOMPUTE, all_configs, default_configs, model_state_configs,
                                            select, streams_model_states, unavailable_reason)
from megatron_longctx.bench.engine import GPTShape
from megatron_longctx.bench.headline import MODEL_STATES_TARGET, model_states_headline, model_states_line
from megatron_longctx.plan.model import param_counts

MODEL = dataclasses.replace(regression.PRESETS["llama-h256"].model, vocab_size=regression.TOKENIZER_VOCAB)
SHAPE = GPTShape(MODEL).to_dict()
DISK, WITHOUT = "ring+offload+states-disk", "ring+offload"


def test_the_budget_counts_the_model_states_and_disk_takes_them_out(tmp_path):
    task = {"cp": 2, "shape": SHAPE, "seed": 1, "lr": 1e-3, "warmup": 0, "steps": 2, "global_batch_size": 2,
            "budget_bytes": None, "data_dir": str(tmp_path / "data"), "configs": [FLASH_RECOMPUTE, WITHOUT, DISK],
            "seq_lengths": [256]}
    rc, output, records = regression.run_probe_job(task, 2, 300)
    assert rc == 0, output[-3000:]
    by = {r["config"]: r for r in records}
    assert all(r["status"] == "ok" for r in records) and set(by) == {FLASH_RECOMPUTE, WITHOUT, DISK}, records
    states = 16 * param_counts(MODEL).total  # float32 weight, main gradient, two Adam moments
    base, disk = by[FLASH_RECOMPUTE]["peak_mem_bytes"], by[DISK]["peak_mem_bytes"]
    assert base >= states, f"the baseline's peak {base} does not hold its {states} bytes of model states"
    assert by[WITHOUT]["peak_mem_bytes"] >= states
    assert base - disk >= 0.6 * states, f"disk saves {base - disk} of {states} bytes of model states"
    ms = by[DISK]["model_states"]
    assert ms["target"] == "disk" and ms["inner_optimizers"] == ["OffDeviceAdamW"], ms
    assert ms["model_state_loads"] > 0 and ms["model_state_grad_flushes"] > 0, ms
    assert "model_states" not in by[FLASH_RECOMPUTE]
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(by[DISK][key], dtype=torch.float64),
                                   torch.tensor(by[WITHOUT][key], dtype=torch.float64), rtol=1e-6, atol=0)


def test_with_the_distributed_optimizer_the_streamed_row_shards_its_off_device_adamw(tmp_path):
    """The benchmark's default: Megatron's distributed optimizer on every row.  On the streamed row the plugin
    runs it (each rank keeps its share of Adam's moments off the device), and it trains as the row without the
    streaming, whose moments Megatron's distributed optimizer shards."""
    task = {"cp": 2, "shape": SHAPE, "seed": 1, "lr": 1e-3, "warmup": 0, "steps": 2, "global_batch_size": 2,
            "budget_bytes": None, "data_dir": str(tmp_path / "data"), "configs": [WITHOUT, DISK],
            "seq_lengths": [256], "distributed_optimizer": True}
    rc, output, records = regression.run_probe_job(task, 2, 300)
    assert rc == 0, output[-3000:]
    by = {r["config"]: r for r in records}
    assert [by[c]["optimizer"] for c in (WITHOUT, DISK)] == ["distributed", "off-device sharded"], records
    assert "optimizer states sharded over 2 data x context parallel ranks" in by[DISK]["model_states"]["description"]
    for key in ("losses", "grad_norms"):
        torch.testing.assert_close(torch.tensor(by[DISK][key], dtype=torch.float64),
                                   torch.tensor(by[WITHOUT][key], dtype=torch.float64), rtol=1e-6, atol=0)


def test_the_rows_and_where_they_run():
    rows = model_state_configs(2)
    assert [c.name for c in rows] == [f"{base}+states-{target}" for target in ("disk", "host")
                                      for base in ("ring+offload", "ring+offload+mlp", "allgather+all")]
    defaults = {c.name: c.variant.options() for c in default_configs(2)}
    for c in rows:
        name, target = c.name.rsplit("+states-", 1)
        base = defaults["allgather+all"] if name == "allgather+all" else {
            **defaults["ring+offload"], **({"tiled_mlp_tiles": 4} if name.endswith("+mlp") else {})}
        assert c.variant.options() == {**base, "model_state_offload": target}
        assert streams_model_states(c) and c.variant.context_parallel_size == 2
    assert not any(streams_model_states(c) for c in default_configs(2))  # the default sweep has none
    assert [c.name for c in select(all_configs(2), [DISK])] == ["megatron-unfused", DISK]
    with pytest.raises(ValueError, match="--configs: unknown configuration.*ring\\+all\\+states-nvme"):
        select(all_configs(2), ["ring+all+states-nvme"])
    host = next(c for c in rows if c.name == "ring+offload+states-host")
    reason = unavailable_reason(host, 2, 2)
    if torch.cuda.is_available():
        assert reason is None
    else:
        assert "--longctx-model-state-offload host" in reason and "+states-disk" in reason


def test_the_states_preset_fills_most_of_its_budget():
    args = regression.build_parser().parse_args(["--preset", "llama-states"])
    states_mib = 16 * param_counts(regression.bench_model(args)).total / 2**20
    assert 0.8 < states_mib / regression.PRESETS["llama-states"].budget_mib < 0.9, states_mib


@pytest.mark.skipif(torch.cuda.is_available(), reason="host model-state offload is refused on CPU-only machines")
def test_host_on_the_cpu_and_an_unknown_target_are_refused_naming_the_flag():
    from megatron_longctx.bench.model_states import ModelStates
    from megatron_longctx.config import LongContextConfig
    from megatron_longctx.megatron.plugin import LongContextPlugin

    cfg = LongContextConfig.from_flat({"cp_algorithm": "ring", "model_state_offload": "host"})
    with pytest.raises(ValueError, match="--longctx-model-state-offload host .* use --longctx-model-state-offload disk"):
        ModelStates.install(None, LongContextPlugin(cfg))  # the Trainer's install, refused before it touches the model
    with pytest.raises(ValueError, match="model-state-offload.*nvme"):
        LongContextConfig.from_flat({"cp_algorithm": "ring", "model_state_offload": "nvme"})


def _results(**max_seqs):
    return {name.replace("_", "-"): {"max_seq": v, "at_cap": False, "probes": []} for name, v in max_seqs.items()}


def test_the_model_states_headline():
    roles = {c.name: c.as_dict()["role"] for c in default_configs(2)}  # the rows searched, less the streamed
    streamed = {c.name for c in model_state_configs(2)}
    results = {"megatron-flash+recompute": {"max_seq": 1024, "at_cap": False},
               "megatron-flash+cp+recompute": {"max_seq": 1280, "at_cap": False},
               "allgather+all": {"max_seq": 30720, "at_cap": False},  # not a model-state row: not in this ratio
               "ring+offload+states-disk": {"max_seq": 6144, "at_cap": False},
               "ring+offload+mlp+states-disk": {"max_seq": 8192, "at_cap": True}}
    h = model_states_headline(results, roles, streamed)
    assert (h["best_plugin"], h["strongest_baseline"]) == ("ring+offload+mlp+states-disk", "megatron-flash+cp+recompute")
    r = h["ratio"]
    assert r["ratio"] == pytest.approx(6.4) and r["target"] == MODEL_STATES_TARGET and r["meets_target"]
    assert model_states_line(h) == (
        "max trainable sequence with model states counted: ring+offload+mlp+states-disk 8192 (cap) / strongest "
        "baseline megatron-flash+cp+recompute 1280 = ≥ 6.4x (target >= 4x: met)")
    assert model_states_headline({k: v for k, v in results.items() if k not in streamed}, roles, streamed) is None
    nothing = model_states_headline(dict(results, **{"megatron-flash+recompute": {"max_seq": 0},
                                                     "megatron-flash+cp+recompute": {"max_seq": 0}}), roles, streamed)
    assert nothing["ratio"] is None and "no ratio" in model_states_line(nothing)


def _grad_buffer_allocations(disk_dir: str, streamed: bool):
    from megatron_longctx.bench.engine import OptimConfig, Trainer, Variant
    from megatron_longctx.megatron import cpu_compat

    class Zeros(torch.overrides.TorchFunctionMode):
        """Sizes of the floating ``torch.zeros`` that hold memory (DDP's buffers are made by it; a layer's
        stash packs its bytes in a uint8 one)."""

        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.zeros and out.device.type != "meta" and out.dtype.is_floating_point:
                self.sizes.append(out.numel())
            return out

    options = [("cp_algorithm", "ring")]
    options += [("model_state_offload", "disk"), ("offload_disk_dir", disk_dir)] if streamed else []
    shape = GPTShape(dataclasses.replace(MODEL, num_layers=2), seq_length=64)
    with cpu_compat.enabled(), Zeros() as zeros:
        trainer = Trainer(shape, Variant("p", context_parallel_size=2, plugin=True, longctx_options=tuple(options)),
                          OptimConfig(), 1, 1)
        params = sum(p.numel() for p in trainer.model.parameters())
        trainer.close()
    return max(zeros.sizes, default=0), params


def test_the_trainer_lays_ddp_gradient_buffers_out_without_memory_for_a_streamed_model(tmp_path):
    """The benchmark's Trainer wraps a ``disk`` model in DDP as the deferred install does: the gradient buffers
    (one float32 main gradient per weight, which the streamer replaces) are laid out on the meta device, so a
    row's peak never holds them; without the offload DDP allocates them whole."""
    from tests.dist import run_ranks

    streamed = run_ranks(2, _grad_buffer_allocations, str(tmp_path), True)
    whole = run_ranks(2, _grad_buffer_allocations, str(tmp_path), False)
    for (largest, params), (largest_whole, _) in zip(streamed, whole):
        assert largest_whole >= params  # the one buffer of every main gradient
        assert largest < params / 4, f"a {largest}-element buffer was allocated for {params} streamed weights"
