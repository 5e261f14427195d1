"""Recompute (ours) gives the plain model's loss and gradients, dropout included, where Megatron's fails.

Oracle: the same GPTModel without recompute, float64, same seeds.  Megatron's own selective
``layernorm`` (no Transformer Engine) and ``mlp`` (``add_bias_linear=True``) are run in a subprocess to
show they fail there, while ours matches.
"""

import os
import subprocess
import sys

import pytest
import torch

from megatron_longctx.memory import MemoryConfig
from megatron_longctx.memory import hooks
from megatron_longctx.memory.recompute import DiscardOutputPacker, RngSnapshot, checkpoint, discard_output
from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import ORACLE, assert_same, build_gpt, cpu, loss_and_grads

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------ plain torch unit


class _Block(torch.nn.Module):
    """Dropout, a dict output, a returned parameter, keyword and non-tensor arguments."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, dtype=torch.float64)
        self.bias = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))

    def forward(self, x, *, scale, mask=None, tag="t"):
        h = torch.nn.functional.dropout(torch.tanh(self.lin(x)) * scale, p=0.3, training=True)
        if mask is not None:
            h = h * mask
        return {"out": h, "bias": self.bias, "tag": tag, "none": None}


def _run(block, x, use_checkpoint):
    torch.manual_seed(3)
    mask = torch.ones(8, dtype=torch.float64)
    call = (lambda *a, **k: checkpoint(block, *a, **k)) if use_checkpoint else block
    out = call(x, scale=2.0, mask=mask, tag="u")
    assert out["tag"] == "u" and out["none"] is None and out["bias"] is block.bias
    loss = (out["out"] ** 2).sum() + (out["bias"] * out["out"].sum(0)).sum()
    loss.backward()
    return loss.detach(), {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in block.named_parameters()}}


def test_checkpoint_replays_dropout_and_passes_parameters_through():
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    ref = _run(block, x, False)
    block.zero_grad()
    x.grad = None
    got = _run(block, x, True)
    assert_same(ref, got)
    # the oracle can fail: another dropout draw changes the loss
    torch.manual_seed(4)
    other = block(x, scale=2.0)["out"]
    torch.manual_seed(3)
    assert not torch.equal(other, block(x, scale=2.0)["out"])


def test_rng_snapshot_rewinds_the_cpu_generator():
    snap = RngSnapshot.capture()
    a = torch.rand(4)
    snap.restore()
    assert torch.equal(a, torch.rand(4))


def _norm_then_two_linears(x, norm, lin1, lin2):
    """The output, and whether the second linear's input took the freed norm output's memory."""
    h = norm(x)
    a = lin1(h)  # saves h: the recipe, not the values
    address = h.data_ptr()
    del h  # freed: the allocator hands its memory to the next tensor of its size
    g = torch.tanh(a)  # same shape, version 0
    return lin2(g), g.data_ptr() == address


def test_a_freed_norm_output_is_not_mistaken_for_the_tensor_at_its_address():
    """The discard packer matches a saved tensor by storage, shape and version; a norm output that died
    must not claim the next activation allocated where it lived (it would be recomputed as the norm)."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(32, dtype=torch.float64)
    lin1, lin2 = (torch.nn.Linear(32, 32, dtype=torch.float64) for _ in range(2))
    reused = 0
    for _ in range(200):  # until the allocator has reused that memory a few times
        if reused >= 3:
            break
        x = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
        params = [x, *lin1.parameters(), *lin2.parameters()]
        ref = torch.autograd.grad(_norm_then_two_linears(x, norm, lin1, lin2)[0].square().sum(), params)
        packer = DiscardOutputPacker()
        remove = discard_output(norm, packer)
        with hooks.packing(packer):
            out, same_address = _norm_then_two_linears(x, norm, lin1, lin2)
        remove()
        reused += same_address
        for r, g in zip(ref, torch.autograd.grad(out.square().sum(), params)):
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    assert reused, "the allocator never reused the norm output's memory: the case was not exercised"


# ----------------------------------------------------------------------------- Megatron GPTModel

CASES = [
    MemoryConfig(recompute_granularity="full"),
    MemoryConfig(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    *[MemoryConfig(recompute_granularity="selective", recompute_modules=(m,))
      for m in ("core_attn", "qkv", "proj", "mlp", "layernorm")],
    MemoryConfig(recompute_granularity="selective", recompute_modules=("core_attn", "qkv", "proj", "mlp", "layernorm")),
]


def _recompute_matches_plain(cfg):
    from megatron_longctx.megatron.memory_spec import install

    with cpu(), megatron_parallel(tp=2):
        ref = loss_and_grads(build_gpt(**ORACLE, add_bias_linear=True))
        model = build_gpt(**ORACLE, add_bias_linear=True)
        handle = install(model, cfg)
        got = loss_and_grads(model)
        assert_same(ref, got)
        handle.remove()
        assert "forward" not in model.decoder.layers[0].__dict__
        assert_same(ref, loss_and_grads(build_gpt(**ORACLE, add_bias_linear=True)))  # unchanged after remove()


def _case_id(cfg):
    if cfg.recompute_granularity == "full":
        return f"full-{cfg.recompute_method}{cfg.recompute_num_layers or ''}"
    return "selective-" + "+".join(cfg.recompute_modules)


@pytest.mark.parametrize("cfg", CASES, ids=_case_id)
def test_recompute_matches_plain_model_tp2_with_dropout(cfg):
    run_ranks(2, _recompute_matches_plain, cfg)


def _megatron_recompute_refused_with_ours_on():
    from megatron_longctx.megatron.memory_spec import install

    with cpu(), megatron_parallel(tp=2):
        model = build_gpt(**ORACLE, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        with pytest.raises(ValueError, match="--recompute-granularity: the plugin runs the recompute"):
            install(model, MemoryConfig(recompute_granularity="full"))


def test_megatron_and_our_recompute_together_is_an_error():
    run_ranks(2, _megatron_recompute_refused_with_ours_on)


def test_megatron_selective_recompute_fails_where_ours_works():
    """Megatron's selective ``layernorm`` raises without TE; its ``mlp`` with bias never finishes."""
    env = dict(os.environ, PYTHONPATH=REPO)
    cmd = [sys.executable, "-m", "tests.memory.megatron_failure"]
    layernorm = subprocess.Popen(cmd + ["layernorm"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
    mlp = subprocess.Popen(cmd + ["mlp"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           text=True)
    try:
        out, _ = layernorm.communicate(timeout=120)
        assert "FAILED NameError" in out, out
        try:
            out, _ = mlp.communicate(timeout=15)
            assert "FAILED" in out, out  # a RecursionError where the recursion reaches Python's limit
        except subprocess.TimeoutExpired:  # endless recursion in backward, long after the forward finished
            mlp.kill()
            out, _ = mlp.communicate()
            assert "FORWARD DONE" in out and "OK" not in out, out
    finally:
        for proc in (layernorm, mlp):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
