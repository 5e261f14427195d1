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


def same_states(ref_units: list, streamer: ModelStateStreamer) -> None:
    """Each unit's off-device weights and gradients equal the reference's parameters and their ``.grad``, bit
    for bit (a unit is a module or a tuple of them)."""
    for i, unit in enumerate(ref_units):
        params = [p for m in (unit if isinstance(unit, tuple) else (unit,)) for p in m.parameters()]
        weights, grads = streamer.unit_weights(i), streamer.unit_grads(i)
        assert len(weights) == len(grads) == len(params)
        for p_ref, w, g in zip(params, weights, grads):
            assert_close(w, p_ref.detach(), rtol=0, atol=0)
            assert_close(g, p_ref.grad, rtol=0, atol=0)


def _loss(model: Stack, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))


def _micro_batch(ref: Stack, model: Stack, streamer: ModelStateStreamer, tokens: torch.Tensor) -> None:
    """One micro-batch's forward and backward through both: the same loss, every slot released after."""
    want = _loss(ref, tokens)
    want.backward()
    got = _loss(model, tokens)
    assert_close(got, want, rtol=0, atol=0)
    got.backward()
    streamer.finish_backward()
    streamer.check_released()


@pytest.mark.parametrize("target", ["host", "disk"])
@pytest.mark.parametrize("recompute", [False, True])
def test_outputs_and_grads_bit_for_bit(target: str, recompute: bool, tmp_path) -> None:
    torch.manual_seed(0)
    ref = Stack(recompute=recompute)
    model = copy.deepcopy(ref)
    streamer = _streamer(model, target, tmp_path)
    batches = [torch.randint(0, 32, (2, 8)) for _ in range(3)]  # three micro-batches, accumulated
    for tokens in batches:
        _micro_batch(ref, model, streamer, tokens)
    same_states(ref.units(), streamer)
    streamer.remove()


class Shift(torch.nn.Module):
    """Adds its bias into its input in place and hands the input back: the output is the input object."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(self.bias)


class Through(torch.nn.Module):
    """A norm whose call passes its input through (its weight is used by the head's call, as the tiled loss's
    recompute does with the final norm)."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ShiftStack(Stack):
    def __init__(self) -> None:
        super().__init__(n=2)
        self.shift, self.through = Shift(16), Through(16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.blocks[1](self.shift(self.blocks[0](self.embed(tokens))))
        return self.head(self.through(x) * self.through.weight)

    def units(self) -> list:
        return [self.embed, self.blocks[0], self.shift, self.blocks[1], (self.through, self.head)]


def test_an_output_over_its_input_starts_the_units_backward_and_a_passed_input_does_not(tmp_path) -> None:
    """A unit whose output is its input written in place (the tiled replay's output over its input) gets its
    gradients; a module handing its input back untouched does not start its unit's backward a second time
    (one gradient flush per unit and micro-batch)."""
    torch.manual_seed(1)
    ref = ShiftStack()
    model = copy.deepcopy(ref)
    streamer = _streamer(model, "host", tmp_path)
    for step in range(2):
        _micro_batch(ref, model, streamer, torch.randint(0, 32, (2, 8)))
        assert streamer.grad_flushes == (step + 1) * len(model.units())
    same_states(ref.units(), streamer)
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


@pytest.mark.parametrize("recompute", [False, True])
def test_disk_reads_the_next_unit_ahead_of_its_use(recompute: bool, tmp_path) -> None:
    """``disk``: while a unit computes, the next one's file is read on the reader thread; every unit but each
    pass's first is loaded from that read (none read twice, none read in vain), and the results are those of
    the model without streaming, bit for bit."""
    torch.manual_seed(0)
    ref = Stack(n=5, recompute=recompute)
    model = copy.deepcopy(ref)
    streamer = _streamer(model, "disk", tmp_path)
    tokens = torch.randint(0, 32, (2, 8))
    _micro_batch(ref, model, streamer, tokens)
    n = len(streamer.units)
    # one load per unit in forward and one for its backward (a recompute's stays for the backward); all but
    # the first of each pass served by the read ahead
    assert streamer.loads == 2 * n
    assert streamer.reads_ahead_used == streamer.prefetches == 2 * (n - 1)
    same_states(ref.units(), streamer)
    streamer.remove()


def test_a_unit_file_that_cannot_be_read_ahead_names_the_flag(tmp_path) -> None:
    """A weight file cut short under the reader thread: the load that waits for the read raises one error
    naming the flag, the unit and the bytes."""
    torch.manual_seed(0)
    model = Stack()
    streamer = _streamer(model, "disk", tmp_path)
    os.truncate(streamer.units[1].path, 8)
    with pytest.raises(ModelStateError, match=r"--longctx-model-state-offload disk: reading unit 1's weights "
                                              rf"\({streamer.units[1].nbytes} bytes\) failed"):
        _loss(model, torch.randint(0, 32, (2, 8)))
    assert streamer.prefetches == 1 and streamer.reads_ahead_used == 0
    streamer.remove()


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
    streamer._pre_forward(streamer.units[1], ((), {}))  # a forward that never finished: its weights stay in the slot
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
