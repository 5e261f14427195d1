"""Parameters never offloaded after Megatron moves them; tensor subclasses kept; no prefetch across chunks.

Megatron moves parameters after the model is built (``.cuda()`` after ``--use-cpu-initialization``;
``--use-distributed-optimizer`` points every parameter into one DDP buffer).  The offloader reads the
addresses again at every micro-batch, so a view of a moved weight is still recognised as a weight.
"""

import torch
from torch.testing._internal.two_tensor import TwoTensor

from megatron_longctx.memory import MemoryConfig, hooks
from megatron_longctx.memory.offload import ActivationOffloader
from tests.memory.fake_streams import RecordingOps

CFG = MemoryConfig(offload_policy="layers", offload_target="host", offload_min_bytes=0)


def _step(off, w, seed=0):
    x = torch.randn(16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    off.next_microbatch()
    with hooks.packing(off), hooks.layer_scope(0):
        y = torch.tanh(x @ w.t())  # saves x, a view of w (w.t()), and the tanh output
    (y ** 2).sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    (torch.tanh(ref_x @ w.detach().t()) ** 2).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)


class _Ops(RecordingOps):
    """Also notes the storage address of every tensor copied on the side stream."""

    def __init__(self):
        super().__init__()
        self.offloaded = []

    def copy(self, dst, src):
        if self._stack[-1].name == "side":
            self.offloaded.append(src.untyped_storage().data_ptr())
        super().copy(dst, src)


def _moves(w: torch.nn.Parameter, how: str) -> None:
    if how == "to_device":  # what module.cuda() does to each parameter: new storage, same Parameter object
        w.data = w.data.clone()
    else:  # the DDP parameter buffer: every parameter a view into one flat buffer
        buf = torch.zeros(w.numel() + 64, dtype=w.dtype)
        buf[64:].copy_(w.data.view(-1))
        w.data = buf[64:].view_as(w)


def test_moved_parameters_are_still_excluded():
    for how in ("to_device", "ddp_buffer"):
        w = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.float64) / 4)
        ops = _Ops()
        off = ActivationOffloader(CFG, params=lambda: [w], ops=ops)
        _step(off, w)
        assert off.stats.offloaded_tensors == 2  # x and tanh's output; never the view w.t()
        _moves(w, how)
        ops.offloaded.clear()
        _step(off, w, seed=1)
        assert w.untyped_storage().data_ptr() not in ops.offloaded, how
        assert off.stats.offloaded_tensors == 4 and off.stats.param_refreshes == 2, (how, off.stats)


def test_captured_addresses_would_offload_the_moved_weight():
    """The defect the refresh fixes: addresses read once at construction miss the moved weight."""
    w = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.float64) / 4)
    ops = _Ops()
    off = ActivationOffloader(CFG, params=[w], ops=ops)
    off._params_ptrs()
    off.next_microbatch = lambda: None  # as if the addresses were never read again
    _moves(w, "ddp_buffer")
    _step(off, w)
    assert w.untyped_storage().data_ptr() in ops.offloaded  # weight bytes copied for nothing


def test_tensor_subclasses_are_left_to_autograd():
    ops = RecordingOps()
    off = ActivationOffloader(CFG, ops=ops)
    a, b = (torch.randn(8, 8, dtype=torch.float64) for _ in range(2))
    t = TwoTensor(a, b).requires_grad_()
    with hooks.packing(off), hooks.layer_scope(0):
        y = (t * t).sum()
    assert off.stats.subclass_kept_bytes > 0 and off.stats.offloaded_tensors == 0
    y.backward()
    torch.testing.assert_close(t.grad.a, 2 * a)
    # a subclass parameter (e.g. an FP8 weight) excludes the storages of its inner tensors
    wp = torch.nn.Parameter(TwoTensor(a.clone(), b.clone()))
    off2 = ActivationOffloader(CFG, params=[wp], ops=ops)
    assert {a_.untyped_storage().data_ptr() for a_ in (wp.a, wp.b)} <= off2._params_ptrs()


def test_no_prefetch_across_model_chunks():
    """Virtual pipeline: layer 2 begins chunk 1; its backward must not fetch chunk 0's layer 1."""
    ops = RecordingOps()
    off = ActivationOffloader(CFG, ops=ops, num_layers=4, chunk_starts=(0, 2))
    x = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.float64) / 4)
    off.next_microbatch()
    h, outs = x, []
    with hooks.packing(off):
        for layer in range(4):
            if layer == 2:  # a chunk's input arrives from the pipeline (p2p), a tensor of its own
                boundary = h.detach().clone().requires_grad_()
                h = boundary
            with hooks.layer_scope(layer):
                h = torch.tanh(h @ w)
            outs.append(h)
    assert set(off._groups) == {(1, 0), (1, 1), (1, 2), (1, 3)}
    outs[3].sum().backward(inputs=[boundary])  # chunk 1's backward: layers 3 then 2
    assert set(off._groups) == {(1, 0), (1, 1)}  # chunk 0's layer 1 not fetched from chunk 1's first layer
    outs[1].backward(boundary.grad, inputs=[x])  # chunk 0's backward, scheduled later
    assert not off._groups
    ref_x = x.detach().clone().requires_grad_()
    r = ref_x
    for _ in range(4):
        r = torch.tanh(r @ w.detach())
    r.sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
