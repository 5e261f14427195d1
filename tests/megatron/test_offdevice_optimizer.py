"""Megatron's optimizer (``get_megatron_optimizer``: FP32Optimizer, or Float16OptimizerWithFloat16Params
under bf16) with its inner AdamW swapped for the off-device one: a small GPTModel trained for a few steps
(Megatron's clipping on, weight decay in one parameter group and not the other) ends with the weights of
the unswapped run, bit for bit; Megatron's optimizer checkpoint resumes it bit for bit."""

import pytest
import torch

from megatron_longctx.plan.model import ModelShape
from tests.dist import run_ranks

SMALL = ModelShape(name="small", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   kv_channels=16, ffn_hidden_size=224, vocab_size=512, activation="swiglu", normalization="RMSNorm",
                   add_bias_linear=True)
SEQ, STEPS = 32, 3


def _batches():
    g = torch.Generator().manual_seed(3)
    return [{"tokens": torch.randint(0, 512, (2, SEQ), generator=g),
             "labels": torch.randint(0, 512, (2, SEQ), generator=g),
             "loss_mask": torch.ones(2, SEQ), "position_ids": torch.arange(SEQ).expand(2, SEQ)} for _ in range(STEPS)]


def _train(bf16, target, root, resume_at=None):
    from megatron_longctx.bench.engine import GPTShape, OptimConfig, Trainer, Variant
    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.megatron.offdevice_optimizer import install, megatron_optimizers
    from megatron_longctx.memory.host_pool import HostPool
    from megatron_longctx.memory.offdevice_optimizer import OffDeviceAdamW, OffDeviceSpec

    def build(sub):
        trainer = Trainer(GPTShape(SMALL, seq_length=SEQ, bf16=bf16), Variant("b"),
                          OptimConfig(weight_decay=0.1, clip_grad=0.05), 2, 1)
        installed = None
        if target is not None:
            spec = OffDeviceSpec(target, HostPool(1 << 20, pin=False), f"{root}/{sub}", chunk_numel=4096)
            installed = install(trainer.optimizer, spec)
            assert all(isinstance(o.optimizer, OffDeviceAdamW) for o in megatron_optimizers(trainer.optimizer))
        # Megatron's scheduler sets each group's lr and weight decay (wd_mult 0: biases and norms)
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        for g in trainer.optimizer.param_groups:  # what OptimizerConfig(min_lr=1e-4) would have set
            g["max_lr"], g["min_lr"] = 1e-3, 1e-4
        sched = OptimizerParamScheduler(trainer.optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=1,
                                        lr_decay_steps=STEPS, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=STEPS, wd_incr_style="constant")
        return trainer, installed, sched

    with cpu_compat.enabled():
        trainer, installed, sched = build("a")
        norms, wds = [], set()
        init = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        for i, b in enumerate(_batches()):
            if i == resume_at:  # Megatron's optimizer checkpoint into a fresh model and optimizer
                saved = trainer.optimizer.state_dict()
                weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
                trainer.close()
                installed.remove() if installed else None
                trainer, installed, sched = build("b")
                sched.num_steps = i
                with torch.no_grad():
                    for n, p in trainer.model.named_parameters():
                        p.copy_(weights[n])
                trainer.optimizer.load_state_dict(saved)
            sched.step(1)
            wds |= {g["weight_decay"] for g in megatron_optimizers(trainer.optimizer)[0].optimizer.param_groups}
            norms.append(trainer.step(i, b).grad_norm)
        out = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        # the fp32 master weights the inner optimizer updated (Megatron's copies under bf16)
        out.update({f"master{i}": p.detach().clone() for i, p in enumerate(
            p for o in megatron_optimizers(trainer.optimizer) for g in o.optimizer.param_groups for p in g["params"])})
        kind = [type(o).__name__ for o in megatron_optimizers(trainer.optimizer)]
        trainer.close()
        installed.remove() if installed else None
    return out, norms, sorted(wds), kind, init


def _clipping_runs_on_a_cpu() -> bool:
    """megatron-core 0.16's gradient clipping of a ChainedOptimizer meets its CUDA-type assert on a CPU even
    under cpu_compat; 0.17 and later run it."""
    from megatron.core import __version__

    return tuple(int(x) for x in __version__.split("+")[0].split(".")[:2]) >= (0, 17)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_swapped_inner_optimizer_trains_as_megatron(bf16, tmp_path):
    if not _clipping_runs_on_a_cpu():
        pytest.skip("megatron-core 0.16's gradient clipping asserts CUDA tensors on a CPU: this CPU test needs "
                    "megatron-core >= 0.17")
    ref, ref_norms, wds, kind, start = run_ranks(1, _train, bf16, None, str(tmp_path))[0]
    assert kind == ["Float16OptimizerWithFloat16Params" if bf16 else "FP32Optimizer"]
    assert wds == [0.0, 0.1]  # Megatron's groups: no decay on biases and norms
    for target in ("host", "disk"):
        got, norms, _, _, _ = run_ranks(1, _train, bf16, target, str(tmp_path / target))[0]
        resumed, _, _, _, _ = run_ranks(1, _train, bf16, target, str(tmp_path / f"{target}-resume"), 2)[0]
        assert got.keys() == ref.keys()
        assert norms == ref_norms
        for name, w in ref.items():
            assert w.dtype == (torch.bfloat16 if bf16 and not name.startswith("master") else torch.float32)
            torch.testing.assert_close(got[name], w, rtol=0, atol=0, msg=lambda m, n=name: f"{target} {n}: {m}")
            torch.testing.assert_close(resumed[name], w, rtol=0, atol=0, msg=lambda m, n=name: f"resumed {n}: {m}")
            if name in start and (w.dim() > 1 or not bf16):  # the steps moved it (bf16 norms round back to 1)
                assert not torch.equal(w, start[name]), name


def test_refuses_an_inner_optimizer_that_is_not_adamw(tmp_path):
    import types

    from megatron_longctx.memory.host_pool import HostPool
    from megatron_longctx.memory.offdevice_optimizer import OffDeviceSpec
    from megatron_longctx.megatron.offdevice_optimizer import install

    p = torch.zeros(8, requires_grad=True)
    spec = OffDeviceSpec("host", HostPool(1 << 20, pin=False), chunk_numel=4096)
    for inner, words in ((torch.optim.Adam([p]), "--optimizer adam with decoupled weight decay"),
                         (torch.optim.SGD([p], lr=0.1), "this run's optimizer is SGD")):
        wrapper = types.SimpleNamespace(optimizer=inner)
        with pytest.raises(ValueError, match="--longctx-model-state-offload") as info:
            install(wrapper, spec)
        assert words in str(info.value)
        assert wrapper.optimizer is inner  # left as it was


@pytest.mark.parametrize("total_norm", [0.5, 3.0], ids=["under", "over"])
def test_unit_by_unit_clipping_scales_as_megatron(total_norm):
    """Model-state offload to disk applies Megatron's clipping to each unit's gradients as the step reads them:
    the same coefficient and multiply as ``clip_grad_by_total_norm_fp32`` on all of them at once."""
    if not _clipping_runs_on_a_cpu():
        pytest.skip("megatron-core 0.16's gradient clipping asserts CUDA tensors on a CPU")
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from megatron_longctx.megatron.features.model_state_step import _scale_as_megatron
    from tests.gpt_kit import cpu

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (7, 33, 130)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for t, p in zip(twins, params):
        t.grad = p.grad.clone()
    before = [p.grad.clone() for p in params]
    with cpu():
        clip_grad_by_total_norm_fp32(params, 1.0, total_norm)
    for unit in (twins[:1], twins[1:]):  # two units, one after the other
        _scale_as_megatron(unit, 1.0, total_norm)
    for t, p, b in zip(twins, params, before):
        torch.testing.assert_close(t.grad, p.grad, rtol=0, atol=0)
        assert torch.equal(p.grad, b) == (total_norm < 1.0)  # scaled only when the norm is over the bound
