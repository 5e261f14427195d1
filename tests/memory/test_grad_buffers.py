"""The residual stream's gradient in one buffer: chained plugin backwards write their input gradient
into the plugin-made buffer of their output gradient, never into a gradient anything else can see.

Oracles: torch's RMSNorm composite and the untiled toy layer, float64.
"""

import pytest
import torch

from megatron_longctx.bench.live_memory import LiveTensors
from megatron_longctx.memory import grad_buffers, rmsnorm, tiled_recompute
from megatron_longctx.memory.rmsnorm import lean_rms_norm
from tests.memory.test_tiled_recompute import _ToyLayer


def _norm_chain(x0, weights, dy, norm, watch=None):
    """``norm`` applied len(weights) times to ``x0 * 1.5``; the gradients of x0 and the weights.

    ``watch(i, y)`` may register a hook on (or retain the gradient of) the i-th norm's output."""
    ws = [w.clone().requires_grad_() for w in weights]
    x = x0.clone().requires_grad_()
    y = x * 1.5
    for i, w in enumerate(ws):
        y = norm(y, w)
        if watch is not None:
            watch(i, y)
    y.backward(dy)
    return [x.grad] + [w.grad for w in ws]


def _torch_norm(y, w):
    return torch.nn.functional.rms_norm(y, (y.shape[-1],), w, 1e-5)


def _lean_norm(y, w):
    return lean_rms_norm(y, w, 1e-5)


def _inputs(n=3, shape=(64, 2, 32)):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(*shape, dtype=torch.float64, generator=g)
    weights = [1 + 0.1 * torch.randn(shape[-1], dtype=torch.float64, generator=g) for _ in range(n)]
    return x0, weights, torch.randn(*shape, dtype=torch.float64, generator=g)


def test_chained_lean_norms_match_float64_in_one_gradient_buffer(monkeypatch):
    monkeypatch.setattr(rmsnorm, "BACKWARD_ROWS", 16)  # several steps per norm: rows read, then written
    x0, weights, dy = _inputs()
    want = _norm_chain(x0, weights, dy, _torch_norm)
    for got, ref in zip(_norm_chain(x0, weights, dy, _lean_norm), want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)

    def peak(reuse: bool) -> int:
        if not reuse:
            monkeypatch.setattr(grad_buffers, "reusable", lambda *a: False)
        x = (x0 * 1).requires_grad_()
        h = x * 1.5
        y = h
        for w in weights:
            y = lean_rms_norm(y, w, 1e-5)
        with LiveTensors() as live:
            held = (dy.view_as(dy), x.view_as(x), h.view_as(h))
            start = live.peak = live.live
            torch.autograd.grad(y, x, dy)
            del held
        monkeypatch.undo()
        return live.peak - start

    buffer = x0.numel() * 8
    step = 16 * 32 * 8
    shared, separate = peak(True), peak(False)
    # one [s, b, h] gradient buffer from the last norm down (plus the input's own, x * 1.5's backward),
    # against two alive at once norm by norm without reuse
    assert shared <= 2 * buffer + 4 * step, (shared, buffer)
    assert separate >= 3 * buffer, (separate, buffer)


@pytest.mark.parametrize("seen", ["hook", "retain_grad"])
def test_a_gradient_something_else_sees_is_never_overwritten(seen, monkeypatch):
    """A tensor hook that keeps the middle norm output's gradient, or retain_grad on it: that gradient
    stays what it is, and every result matches float64."""
    monkeypatch.setattr(rmsnorm, "BACKWARD_ROWS", 16)
    x0, weights, dy = _inputs()
    kept_lean, kept_ref = {}, {}

    def watcher(kept):
        def watch(i, y):
            if i != 1:
                return
            if seen == "hook":
                y.register_hook(lambda g: kept.__setitem__("grad", g))
            else:
                y.retain_grad()
                kept["tensor"] = y
        return watch

    want = _norm_chain(x0, weights, dy, _torch_norm, watcher(kept_ref))
    got = _norm_chain(x0, weights, dy, _lean_norm, watcher(kept_lean))
    for g, ref in zip(got, want):
        torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12)
    if seen == "hook":
        torch.testing.assert_close(kept_lean["grad"], kept_ref["grad"], rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(kept_lean["tensor"].grad, kept_ref["tensor"].grad, rtol=1e-12, atol=1e-12)


def test_stacked_tiled_layers_share_one_gradient_buffer(monkeypatch):
    """Two tiled toy layers: the first writes its input gradient into the second's, tile by tile after
    consuming it; same gradients as float64 untiled, one [s, b, h] buffer less at the backward peak."""
    torch.manual_seed(3)
    layers = [_ToyLayer(), _ToyLayer()]
    params = [p for layer in layers for p in layer.parameters()]
    s, b, h = 256, 1, 16
    x0 = torch.randn(s, b, h, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(s, b, h, dtype=torch.float64)

    def run(tiles, reuse=True):
        if not reuse:
            monkeypatch.setattr(grad_buffers, "reusable", lambda *a: False)
        y = x0 * 1.5
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):  # a copying packer
            for layer in layers:
                y, _ = (tiled_recompute.tiled_checkpoint(layer, tiles, layer.parameters, y, port=layer.replay_port)
                        if tiles else layer(y))
        with LiveTensors() as live:
            held = (dy.view_as(dy), x0.view_as(x0), *(p.view_as(p) for p in params))
            start = live.peak = live.live
            grads = torch.autograd.grad(y, (x0, *params), dy)
            del held
        monkeypatch.undo()
        return grads, live.peak - start

    want, _ = run(0)
    got, shared = run(8)
    for g, ref in zip(got, want):
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-12)
    got, separate = run(8, reuse=False)
    for g, ref in zip(got, want):
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-12)
    assert shared <= separate - s * b * h * 8, (shared, separate)


def test_tiled_layer_adds_parameter_gradients_into_megatron_main_grad():
    """Parameters under Megatron's DDP (main_grad, grad_added_to_main_grad): each tile's gradients go into
    main_grad (on top of what it held), the flag is set, and the layer keeps no sum of its own."""
    torch.manual_seed(4)
    layer = _ToyLayer()
    params = list(layer.parameters())
    x0 = torch.randn(64, 1, 16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(64, 1, 16, dtype=torch.float64)
    y, _ = layer(x0 * 1.5)
    want = torch.autograd.grad(y, (x0, *params), dy)
    earlier = [torch.randn(p.shape, dtype=torch.float32) for p in params]
    for p, e in zip(params, earlier):
        p.main_grad, p.grad_added_to_main_grad = e.clone(), False
    y, _ = tiled_recompute.tiled_checkpoint(layer, 4, layer.parameters, x0 * 1.5, port=layer.replay_port)
    (dx,) = torch.autograd.grad(y, x0, dy)
    torch.testing.assert_close(dx, want[0], rtol=1e-10, atol=1e-12)
    for p, e, g in zip(params, earlier, want[1:]):
        assert p.grad_added_to_main_grad is True
        torch.testing.assert_close(p.main_grad.double() - e.double(), g, rtol=1e-5, atol=1e-5)
