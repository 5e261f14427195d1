"""The optimizer step of ``--longctx-model-state-offload disk``: AdamW with its moments on disk brings one
unit's gradients (pass 1) and then one unit's weights (pass 2) onto the host at a time, so the host never
holds the whole model, and the result equals ``torch.optim.AdamW`` on the same model bit for bit."""

from __future__ import annotations

import contextlib
import copy

import torch
from torch.testing import assert_close

from megatron_longctx.bench.live_memory import LiveTensors
from megatron_longctx.memory.host_pool import HostPool
from megatron_longctx.memory.offdevice_optimizer import OffDeviceAdamW, OffDeviceSpec
from tests.memory.test_model_states import Stack, _loss, _streamer

CHUNK = 4096  # elements per staging chunk: smaller than every unit, so a unit is never staged whole


class Counting:
    """The streamer as the step's source, counting what is brought in and how much at once."""

    def __init__(self, streamer) -> None:
        self.s, self.open, self.most_open, self.calls = streamer, 0, 0, []

    def param_groups(self):
        return self.s.param_groups()

    @contextlib.contextmanager
    def _counted(self, kind: str, index: int, ctx):
        self.calls.append((kind, index))
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            with ctx as params:
                yield params
        finally:
            self.open -= 1

    def grads_in(self, index: int):
        return self._counted("grads", index, self.s.grads_in(index))

    def weights_in(self, index: int):
        return self._counted("weights", index, self.s.weights_in(index))


def test_disk_step_one_unit_at_a_time_equals_adamw(tmp_path) -> None:
    torch.manual_seed(0)
    model = Stack(h=64, n=4, vocab=128)
    ref = copy.deepcopy(model)
    streamer = _streamer(model, "disk", tmp_path / "states")
    source = Counting(streamer)
    spec = OffDeviceSpec(target="disk", pool=HostPool(1 << 22, pin=False), disk_dir=str(tmp_path / "opt"),
                         chunk_numel=CHUNK, source=source)
    opt = OffDeviceAdamW(list(model.parameters()), spec, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    units = len(streamer.units)
    unit_bytes = min(u.nbytes for u in streamer.units)
    assert unit_bytes > CHUNK * 4
    model_bytes = sum(u.nbytes + u.gbytes for u in streamer.units)
    for step in range(3):
        tokens = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(step))
        for m in (model, ref):
            _loss(m, tokens).backward()
        streamer.finish_backward()
        source.calls.clear()
        with LiveTensors() as live:
            opt.step()
        ref_opt.step()
        ref_opt.zero_grad()
        streamer.zero_grad()
        # every unit's gradients, then every unit's weights, each brought in once, one at a time
        assert source.calls == [("grads", i) for i in range(units)] + [("weights", i) for i in range(units)]
        assert source.most_open == 1
        # what the step holds: the optimizer's three staging chunks (moments and denominator) and the
        # streamer's staging buffer (one unit), never the model's weights or gradients whole
        staged = 3 * CHUNK * 4 + streamer._staging.numel()
        assert live.peak <= staged + 1024 < model_bytes, (live.peak, staged, live.peak_by_label)
        for i, unit in enumerate(ref.units()):
            for w, p_ref in zip(streamer.unit_weights(i), unit.parameters()):
                assert_close(w, p_ref.detach(), rtol=0, atol=0)
    streamer.check_released()
    opt.close()
    streamer.remove()
