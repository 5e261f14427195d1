"""Megatron's gradient-accumulation fusion under the plugin's own parameter-gradient collection.

With ``gradient_accumulation_fusion`` a Megatron linear adds its weight gradient into ``main_grad`` in
its backward, sets ``grad_added_to_main_grad`` and returns a placeholder of unread memory.  The tiled
replay, the recomputing tiled loss and the final norm inside it collect parameter gradients with
``torch.autograd.grad`` themselves: they must drop that placeholder (here NaN, so a sum shows it).

Oracle: the same layers unfused and untiled in float64; Megatron's DDP hook is emulated (it adds
``.grad`` into ``main_grad`` unless the flag is set, then drops ``.grad``).
"""

import torch

from megatron_longctx.memory import grad_buffers, tiled_loss, tiled_recompute
from tests.memory.test_tiled_recompute import _ToyLayer


class _FusedLinearFn(torch.autograd.Function):
    """Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` with fusion on, on one rank."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        y = torch.matmul(x, weight.t())
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        grad_x = torch.matmul(g, weight)
        weight.main_grad.add_(g.reshape(-1, g.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1])))
        weight.grad_added_to_main_grad = True
        placeholder = torch.full_like(weight, float("nan"))  # torch.empty / TE's dummy: unread memory
        grad_bias = g.reshape(-1, g.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, placeholder, grad_bias


class _FusedLinear(torch.nn.Linear):
    def forward(self, x):
        return _FusedLinearFn.apply(x, self.weight, self.bias)


class _FusedToyLayer(_ToyLayer):
    def __init__(self, plain: _ToyLayer):
        super().__init__()
        for name in ("qkv", "out"):
            old = getattr(plain, name)
            new = _FusedLinear(old.in_features, old.out_features, dtype=torch.float64)
            new.load_state_dict(old.state_dict())
            setattr(self, name, new)


class _FusedScale(torch.autograd.Function):
    """A norm weight that follows the fusion protocol: ``y = x * w``."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        w.main_grad.add_((g * x).reshape(-1, x.shape[-1]).sum(0))
        w.grad_added_to_main_grad = True
        return g * w, torch.full_like(w, float("nan"))


class _Norm(torch.nn.Module):
    def __init__(self, h, fused):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(h, dtype=torch.float64))
        self.fused = fused

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        return _FusedScale.apply(x, self.weight) if self.fused else x * self.weight


def _ddp(params, earlier):
    """Megatron's DDP: main_grad (float32, holding an earlier micro-batch's sum) and the post hook."""
    for p, e in zip(params, earlier):
        p.main_grad, p.grad_added_to_main_grad, p.grad = e.clone(), False, None

    def hook():
        for p in params:
            if p.grad is not None and not p.grad_added_to_main_grad:
                p.main_grad.add_(p.grad)
            p.grad = None
    return hook


def test_tiled_replay_honours_fused_weight_accumulation():
    torch.manual_seed(5)
    plain = _ToyLayer()
    fused = _FusedToyLayer(plain)
    x0 = torch.randn(23, 2, 16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(23, 2, 16, dtype=torch.float64)
    y, _ = plain(x0 * 1.5)
    want = torch.autograd.grad(y, (x0, *plain.parameters()), dy)

    params = list(fused.parameters())
    earlier = [torch.randn(p.shape, dtype=torch.float32) for p in params]
    finish = _ddp(params, earlier)
    y, _ = tiled_recompute.tiled_checkpoint(fused, 4, fused.parameters, x0 * 1.5, port=fused.replay_port)
    y.backward(dy)
    finish()
    torch.testing.assert_close(x0.grad, want[0], rtol=1e-10, atol=1e-12)
    for p, e, g in zip(params, earlier, want[1:]):
        assert p.grad_added_to_main_grad is True
        torch.testing.assert_close(p.main_grad.double() - e.double(), g, rtol=1e-5, atol=1e-5)


def test_recomputing_tiled_loss_honours_a_fused_final_norm():
    torch.manual_seed(6)
    s, b, h, vocab = 12, 2, 8, 11
    hidden = torch.randn(s, b, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, h, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (b, s))
    norm_ref = _Norm(h, fused=False)
    norm = _Norm(h, fused=True)
    norm.load_state_dict(norm_ref.state_dict())
    logits = torch.matmul(norm_ref(hidden), weight.t())  # [s, b, V]
    ref_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.t().reshape(-1), reduction="sum")
    want = torch.autograd.grad(ref_loss, (hidden, weight, norm_ref.weight))

    earlier = [torch.randn(h, dtype=torch.float32)]
    finish = _ddp([norm.weight], earlier)
    loss = tiled_loss.tiled_logits_loss(hidden, weight, labels, tiled_loss.TiledLossArgs(3, recompute=True, norm=norm))
    got = torch.autograd.grad(loss.sum(), (hidden, weight, norm.weight))
    norm.weight.grad = got[2]
    finish()
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norm.weight.main_grad.double() - earlier[0].double(), want[2], rtol=1e-5, atol=1e-5)


def test_the_placeholder_is_one_buffer_autograd_takes_without_copying():
    """Every placeholder of one shape shares one buffer, and AccumulateGrad adopts it as ``.grad`` (no
    parameter-sized allocation per backward); under ``zero_out_wgrad`` it reads zero."""
    w = torch.nn.Parameter(torch.randn(6, 4))
    w.main_grad, w.grad_added_to_main_grad = torch.zeros(6, 4), False
    first = grad_buffers.main_grad_placeholder(w)
    second = grad_buffers.main_grad_placeholder(w)
    assert first.data_ptr() == second.data_ptr() and w.grad_added_to_main_grad is True

    class Returns(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2, grad_buffers.main_grad_placeholder(weight_ref)

    weight_ref = w
    for _ in range(2):
        w.grad = None
        Returns.apply(torch.randn(3, requires_grad=True), w).sum().backward()
        assert w.grad.data_ptr() == first.data_ptr()  # taken as it is, not cloned
    w.zero_out_wgrad = True
    first.fill_(7)
    assert grad_buffers.main_grad_placeholder(w).abs().sum() == 0
