"""Checkpoints move between Megatron's own model and the plugin model, both ways, unchanged."""

import io

import torch

from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import WORLD, build_gpt, local_spec, tiny_config
from tests.gpt_kit import batch as global_batch


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(batch["tokens"], batch["position_ids"], None)


def _checkpoint_compat():
    from megatron_longctx import apply_to_spec
    from megatron_longctx.megatron import cpu_compat

    batch = global_batch(seed=8)
    with cpu_compat.enabled():
        with megatron_parallel(tp=2):
            base = build_gpt(tiny_config(2, 1), local_spec())
            plugin = build_gpt(tiny_config(2, 1), apply_to_spec(local_spec()), seed=77)
            assert base.state_dict().keys() == plugin.state_dict().keys()
            base_sharded = base.sharded_state_dict()
            assert base_sharded.keys() == plugin.sharded_state_dict().keys()
            shapes = {k: tuple(v.local_shape) for k, v in base_sharded.items() if hasattr(v, "local_shape")}
            assert shapes == {k: tuple(v.local_shape) for k, v in plugin.sharded_state_dict().items()
                              if hasattr(v, "local_shape")}
            assert not torch.allclose(_logits(base, batch), _logits(plugin, batch))
            plugin.load_state_dict(_roundtrip(base.state_dict()))  # Megatron -> plugin
            torch.testing.assert_close(_logits(plugin, batch), _logits(base, batch), rtol=1e-5, atol=1e-6)
            with torch.no_grad():
                for p in plugin.parameters():
                    p.add_(0.01 * torch.randn_like(p))
            base.load_state_dict(_roundtrip(plugin.state_dict()))  # plugin -> Megatron
            torch.testing.assert_close(_logits(base, batch), _logits(plugin, batch), rtol=1e-5, atol=1e-6)
        with megatron_parallel(tp=1, cp=2):  # the same checkpoint layout at CP=2 (CP does not shard weights)
            plugin_cp = build_gpt(tiny_config(1, 2, cp_comm_type="p2p"), apply_to_spec(local_spec()))
            keys_cp = plugin_cp.sharded_state_dict().keys()
        with megatron_parallel(tp=1):
            assert build_gpt(tiny_config(), local_spec()).sharded_state_dict().keys() == keys_cp


def test_checkpoint_compatibility():
    run_ranks(WORLD, _checkpoint_compat)
