"""Full recompute replayed in sequence tiles (``--longctx-recompute-tiles``) gives the plain model's loss and
gradients, with CP=2 (K/V gathered over the CP group) and with TP=2; what it cannot serve is refused by name.

Oracles: float64 attention over the whole sequence (``tests.oracle``) for the tile attention alone, and the
same GPTModel without memory features, float64, same seeds, for the replayed layers.
"""

import os
import weakref

import pytest
import torch

from megatron_longctx.attention import tiled
from megatron_longctx.attention.args import attention_args
from megatron_longctx.attention.tiled import TiledKV
from megatron_longctx.memory import MemoryConfig, residual_offload, tiled_recompute
from megatron_longctx.memory.tiled_recompute import tile_bounds
from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import ORACLE, ORACLE_SEQ, assert_same, batch, build_gpt, cp_batches, cpu, loss_and_grads
from tests.oracle import sequence_attention


@pytest.mark.parametrize("seq,tiles", [(12, 1), (12, 5), (7, 7), (10, 64)])
def test_tile_bounds_cover_the_sequence_in_order(seq, tiles):
    bounds = tile_bounds(seq, tiles)
    assert bounds[0][0] == 0 and bounds[-1][1] == seq
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and len(bounds) == min(tiles, seq)


@pytest.mark.parametrize("key_block", [2048, 4], ids=["one-key-block", "key-blocks-of-4"])
@pytest.mark.parametrize("window", [None, (5, 0)], ids=["causal", "window5"])
def test_tile_attention_matches_whole_sequence_float64(window, key_block, monkeypatch):
    """One rank: q tiles over the stored K/V give the float64 attention and its q/k/v gradients."""
    monkeypatch.setattr(tiled, "KEY_BLOCK", key_block)
    torch.manual_seed(0)
    s, b, hq, hkv, d = 21, 2, 4, 2, 8
    q, k, v = (torch.randn(s, b, h, d, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv))
    dout = torch.randn(s, b, hq, d, dtype=torch.float64)
    ref = sequence_attention(q, k, v, True, window, d ** -0.5)  # [s, b, hq, d]
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)

    kv = TiledKV(None, s, attention_args(q, True, None, window, None))
    tiles = tile_bounds(s, 4)
    for lo, hi in tiles:
        kv.store(lo, hi, k[lo:hi].detach(), v[lo:hi].detach())
    kv.gather(with_grads=True)
    outs, dq = [], torch.zeros_like(q)
    for lo, hi in tiles:
        q_t = q[lo:hi].detach().requires_grad_(True)
        out_t = kv.attend(q_t, lo, hi)
        (g,) = torch.autograd.grad(out_t, q_t, dout[lo:hi])
        outs.append(out_t.detach())
        dq[lo:hi] = g
    kv.reduce_grads()
    dk, dv = kv.kv_grads(0, s, torch.float64)
    torch.testing.assert_close(torch.cat(outs), ref.detach(), rtol=1e-10, atol=1e-12)
    for got, want in zip((dq, dk, dv), ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _tiled_kv_cp2():
    """CP=2 (zigzag shards): the gathered K/V in rank order, filled in place (one sequence), or reordered to
    natural order (two); output and q/k/v gradients against float64 attention over the whole sequence."""
    import torch.distributed as dist

    rank, cp = dist.get_rank(), 2
    block = tiled.KEY_BLOCK
    tiled.KEY_BLOCK = 4  # several key blocks per shard
    try:
        for b in (1, 2):
            for window in (None, (5, 0)):
                torch.manual_seed(0)
                s, hq, hkv, d = 24, 4, 2, 8
                q, k, v = (torch.randn(s, b, h, d, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv))
                dout = torch.randn(s, b, hq, d, dtype=torch.float64)
                ref = sequence_attention(q, k, v, True, window, d ** -0.5)
                ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
                chunk = s // (2 * cp)
                idx = torch.cat([torch.arange(j * chunk, (j + 1) * chunk) for j in (rank, 2 * cp - 1 - rank)])
                ql, kl, vl = (x.detach()[idx] for x in (q, k, v))
                kv = TiledKV(dist.group.WORLD, len(idx), attention_args(ql, True, None, window, None))
                tiles = tile_bounds(len(idx), 3)
                for lo, hi in tiles:
                    kv.store(lo, hi, kl[lo:hi], vl[lo:hi])
                kv.gather(with_grads=True)
                assert kv.by_rank == (b == 1)
                outs, dq = [], torch.zeros_like(ql)
                for lo, hi in tiles:
                    q_t = ql[lo:hi].clone().requires_grad_(True)
                    out_t = kv.attend(q_t, lo, hi)
                    (dq[lo:hi],) = torch.autograd.grad(out_t, q_t, dout[idx][lo:hi])
                    outs.append(out_t.detach())
                kv.reduce_grads()
                dk, dv = kv.kv_grads(0, len(idx), torch.float64)
                torch.testing.assert_close(torch.cat(outs), ref.detach()[idx], rtol=1e-10, atol=1e-12)
                for got, want in zip((dq, dk, dv), ref_grads):
                    torch.testing.assert_close(got, want[idx], rtol=1e-10, atol=1e-12)
                kv.release()
    finally:
        tiled.KEY_BLOCK = block


def test_tile_attention_cp2_matches_whole_sequence_float64():
    run_ranks(2, _tiled_kv_cp2)


class _ToyLayer(torch.nn.Module):
    """Norm-free pre-attention projection, causal attention, output projection and residual; its attention
    takes part in a tiled replay as ContextParallelAttention does."""

    def __init__(self, h=16, heads=4):
        super().__init__()
        self.heads, self.d = heads, h // heads
        self.qkv = torch.nn.Linear(h, 3 * h, dtype=torch.float64)
        self.out = torch.nn.Linear(h, h, dtype=torch.float64)
        self.replay_port = tiled_recompute.ReplayPort()

    def forward(self, hidden_states, scale=1.0):
        t, b, _ = hidden_states.shape
        q, k, v = (x.reshape(t, b, self.heads, self.d) for x in self.qkv(hidden_states).chunk(3, dim=-1))
        replay = self.replay_port.replay
        if replay is None:
            o = sequence_attention(q, k, v, True, None, self.d ** -0.5)
        else:
            replay.state_for(lambda: TiledKV(None, replay.seq_len, attention_args(q, True, None, None, None)))
            o = replay.step(q, k, v)
        return self.out(o.reshape(t, b, -1)) * scale + hidden_states, None


def test_tiled_checkpoint_of_a_toy_layer_matches_float64_and_keeps_no_input():
    torch.manual_seed(1)
    layer = _ToyLayer()
    x0 = torch.randn(19, 2, 16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(19, 2, 16, dtype=torch.float64)

    def grads(tiles):
        layer.zero_grad()
        h = x0 * 1.5  # the layer input, a non-leaf the caller lets go of
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):  # a copying packer
            y, none = (tiled_recompute.tiled_checkpoint(layer, tiles, layer.parameters, h, port=layer.replay_port, scale=0.5)
                       if tiles else layer(h, scale=0.5))
        alive = weakref.ref(h)
        del h
        kept = alive() is not None
        (dx,) = torch.autograd.grad(y, x0, dy, retain_graph=True)
        y.backward(dy)
        return y.detach(), dx, [p.grad.clone() for p in layer.parameters()], none, kept

    ref_y, ref_dx, ref_dp, _, _ = grads(0)
    y, dx, dp, none, kept = grads(5)
    assert none is None and not kept  # only the packer's copy of the input outlives the forward
    torch.testing.assert_close(y, ref_y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-10, atol=1e-12)
    for got, want in zip(dp, ref_dp):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_an_offloaded_layer_input_comes_back_one_tile_at_a_time(tmp_path):
    from megatron_longctx.memory import hooks
    from megatron_longctx.memory.offload import ActivationOffloader

    torch.manual_seed(2)
    layer = _ToyLayer()
    x0 = torch.randn(19, 2, 16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(19, 2, 16, dtype=torch.float64)
    y_ref, _ = layer(x0 * 1.5)
    ref = torch.autograd.grad(y_ref, (x0, *layer.parameters()), dy)
    off = ActivationOffloader(MemoryConfig(recompute_granularity="full", offload_policy="checkpoint",
                                           offload_target="disk", offload_min_bytes=0, offload_disk_dir=str(tmp_path)))
    with hooks.packing(off), hooks.layer_scope(0):
        y, _ = tiled_recompute.tiled_checkpoint(layer, 5, layer.parameters, x0 * 1.5, port=layer.replay_port)
    got = torch.autograd.grad(y, (x0, *layer.parameters()), dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for g, want in zip(got, ref):
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)
    s = off.stats
    assert s.offloaded_tensors == 1 and s.offloaded_bytes == x0.numel() * 8
    # Each of the three passes reads every tile once, and nothing reads the input whole.
    assert s.row_fetches == 3 * 5 and s.fetched_bytes == 3 * s.offloaded_bytes and s.prefetched_groups == 0
    off.close()


def test_outputs_over_inputs_with_the_residual_gradient_streamed_match_float64(tmp_path):
    """Three tiled layers, each writing its output over its input once the offload has its values, the
    gradient streamed between them: the plain layers' outputs and gradients, and no output buffers."""
    from megatron_longctx.memory import hooks
    from megatron_longctx.memory.offload import ActivationOffloader

    torch.manual_seed(3)
    layers = [_ToyLayer() for _ in range(3)]
    x0 = torch.randn(19, 2, 16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(19, 2, 16, dtype=torch.float64)
    params = [x0, *(p for layer in layers for p in layer.parameters())]
    h = x0 * 1.5
    for layer in layers:
        h, _ = layer(h)
    y_ref, ref = h.detach(), torch.autograd.grad(h, params, dy)

    off = ActivationOffloader(MemoryConfig(recompute_granularity="full", offload_policy="checkpoint",
                                           offload_target="disk", offload_min_bytes=0, offload_disk_dir=str(tmp_path)))
    target = residual_offload.Target(off.disk_dir)
    h = x0 * 1.5
    first = h.data_ptr()
    with hooks.packing(off):
        for i, layer in enumerate(layers):
            with hooks.layer_scope(i):
                out, _ = tiled_recompute.tiled_checkpoint(layer, 5, layer.parameters, h, port=layer.replay_port,
                                                          grad_target=target, output_over_input=True)
            assert out is h and out.data_ptr() == first  # the input tensor, now holding the output
            h = out
    torch.testing.assert_close(h.detach(), y_ref, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(h, params, dy)
    for g, want in zip(got, ref):
        torch.testing.assert_close(g, want, rtol=1e-10, atol=1e-12)
    assert off.stats.offloaded_tensors == 3 and off.stats.deduplicated_bytes == 0  # each input stored as itself
    off.close()


def test_an_offloaded_tensor_written_in_place_is_stored_again(tmp_path):
    """The offload shares one stored copy between tensors of one storage only while it is unmodified."""
    from megatron_longctx.memory import hooks
    from megatron_longctx.memory.offload import ActivationOffloader

    off = ActivationOffloader(MemoryConfig(recompute_granularity="full", offload_policy="checkpoint",
                                           offload_target="disk", offload_min_bytes=0, offload_disk_dir=str(tmp_path)))
    x = torch.arange(64, dtype=torch.float64)
    with hooks.layer_scope(0):
        before = off.pack(x)
        again = off.pack(x[:32])  # the same unmodified storage: shared
        off.wait_stored(before)
        x.add_(1000)
        after = off.pack(x)
    assert off.stats.offloaded_tensors == 2 and off.stats.deduplicated_bytes == 32 * 8
    torch.testing.assert_close(off.unpack(before), torch.arange(64, dtype=torch.float64))
    torch.testing.assert_close(off.unpack(again), torch.arange(32, dtype=torch.float64))
    torch.testing.assert_close(off.unpack(after), torch.arange(64, dtype=torch.float64) + 1000)
    off.close()


def _plugin_spec(**options):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_longctx import apply_to_spec

    return apply_to_spec(get_gpt_layer_local_spec(), **options)


NO_DROPOUT = dict(ORACLE, dropout=0.0)
TILED = [
    MemoryConfig(recompute_granularity="full", recompute_tiles=3),
    MemoryConfig(recompute_granularity="full", recompute_tiles=16, recompute_method="block", recompute_num_layers=1),
    MemoryConfig(recompute_granularity="full", recompute_tiles=5, offload_policy="checkpoint", offload_target="disk",
                 offload_min_bytes=0, tiled_mlp_tiles=2, tiled_loss_tiles=3),
]


def _cp2_tiled_matches_plain():
    block = tiled.KEY_BLOCK
    tiled.KEY_BLOCK = 5  # several key blocks per query tile (restored: the ranks serve other tests after)
    try:
        _cp2_cases()
    finally:
        tiled.KEY_BLOCK = block


def _cp2_cases():
    from megatron.core import parallel_state

    from megatron_longctx.megatron.memory_spec import install

    with cpu(), megatron_parallel(cp=2):
        batches = cp_batches(parallel_state.get_context_parallel_group())
        spec = _plugin_spec(cp_algorithm="allgather")
        ref = loss_and_grads(build_gpt(**NO_DROPOUT, spec=spec, context_parallel_size=2), batches=batches)
        for cfg in TILED:
            options = {"cp_algorithm": "allgather", "tiled_mlp_tiles": cfg.tiled_mlp_tiles}
            model = build_gpt(**NO_DROPOUT, spec=_plugin_spec(**options), context_parallel_size=2)
            handle = install(model, cfg)
            got = loss_and_grads(model, batches=batches)
            # The tiled loss runs in the model's float64, Megatron's cross-entropy in float32.
            tol = dict(rtol=1e-5, atol=1e-7) if cfg.tiled_loss_tiles > 1 else dict(rtol=1e-9, atol=1e-11)
            assert_same(ref, got, **tol)
            if cfg.offload_enabled:  # the layer inputs came back one tile at a time, none whole
                stats = handle.offloader.stats
                assert stats.offloaded_bytes > 0 and stats.row_fetches > 0 and stats.prefetched_groups == 0
                assert stats.fetched_bytes == 3 * stats.offloaded_bytes
            handle.remove()
        _everything_on_cp2(batches)


def _everything_on_cp2(batches):
    """Every memory feature at once (the benchmark's allgather+all), with the logits recomputed: the final
    norm runs inside the loss one tile at a time, the embedding output is gone before the loss, and the
    plugin's gradient buffers are shared; same loss and gradients as the plain model."""
    import gc

    from megatron_longctx.megatron.memory_spec import install

    for normalization, lean, stream in (("LayerNorm", False, False), ("RMSNorm", True, False), ("RMSNorm", True, True)):
        fields = dict(NO_DROPOUT, normalization=normalization, context_parallel_size=2)
        ref = loss_and_grads(build_gpt(**fields, spec=_plugin_spec(cp_algorithm="allgather")), batches=batches)
        model = build_gpt(**fields, spec=_plugin_spec(cp_algorithm="allgather", tiled_mlp_tiles=2))
        cfg = MemoryConfig(recompute_granularity="full", recompute_tiles=4, offload_policy="checkpoint",
                           offload_target="disk", offload_min_bytes=0, tiled_mlp_tiles=2, tiled_loss_tiles=4,
                           tiled_loss_recompute=True, lean_norm=lean, offload_residual_grad=stream,
                           tiled_output_over_input=stream)
        handle = install(model, cfg)
        handed = []
        hand_over = residual_offload.hand_over
        residual_offload.hand_over = lambda consumer, s: handed.append(s.path) or hand_over(consumer, s)
        norm = model.decoder.final_layernorm
        rows, own_forward = [], norm.forward

        def counted(x, *args, **kwargs):
            rows.append(x.shape[0])
            return own_forward(x, *args, **kwargs)

        norm.forward = counted
        embedded, gone = [], []
        model.embedding.register_forward_hook(lambda m, i, out: embedded.append(weakref.ref(out)))

        def at_the_loss(_, inputs):  # returns None: a pre-hook's return value would replace the inputs
            gc.collect()
            alive = [r() for r in embedded if r() is not None]
            if stream:  # every layer wrote its output over its input: one buffer from the embedding to the loss
                gone.append([t.data_ptr() for t in alive] == [inputs[0].data_ptr()])
            else:
                gone.append(not alive)

        model.output_layer.register_forward_pre_hook(at_the_loss)
        try:
            got = loss_and_grads(model, batches=batches)
        finally:
            residual_offload.hand_over = hand_over
        assert_same(ref, got, rtol=1e-5, atol=1e-7)  # Megatron's cross-entropy runs in float32
        # streamed: loss -> last layer -> ... -> first layer, through files in the offload's run directory
        layers = len(model.decoder.layers)
        assert len(handed) == (layers * len(batches) if stream else 0), handed
        assert all(os.path.dirname(path) == handle.offloader.disk_dir for path in handed), handed
        local = ORACLE_SEQ // 2
        assert rows == [local // 4] * 8 * len(batches), rows  # 4 tiles in forward, 4 in backward, per batch
        assert gone == [True] * len(batches)  # the embedding output did not live on to the loss (as itself)
        handle.remove()


def test_tiled_recompute_matches_plain_model_cp2():
    run_ranks(2, _cp2_tiled_matches_plain)


def _tp2_tiled_matches_plain():
    from megatron_longctx.megatron.memory_spec import install

    with cpu(), megatron_parallel(tp=2):
        spec = _plugin_spec()
        ref = loss_and_grads(build_gpt(**NO_DROPOUT, spec=spec, add_bias_linear=True), steps=2)
        model = build_gpt(**NO_DROPOUT, spec=spec, add_bias_linear=True)
        handle = install(model, MemoryConfig(recompute_granularity="full", recompute_tiles=4))
        assert_same(ref, loss_and_grads(model, steps=2))
        handle.remove()
        assert "forward" not in model.decoder.layers[0].__dict__


def test_tiled_recompute_matches_plain_model_tp2_with_biases():
    run_ranks(2, _tp2_tiled_matches_plain)


def _refusals():
    from megatron_longctx.megatron.memory_spec import install

    cfg = MemoryConfig(recompute_granularity="full", recompute_tiles=2)
    with cpu(), megatron_parallel(cp=2):
        with pytest.raises(ValueError, match="--hidden-dropout 0"):
            install(build_gpt(**ORACLE, spec=_plugin_spec(cp_algorithm="allgather"), context_parallel_size=2), cfg)
        model = build_gpt(**NO_DROPOUT, spec=_plugin_spec(cp_algorithm="ring"), context_parallel_size=2)
        install(model, cfg)
        with pytest.raises(ValueError, match="--longctx-cp-algorithm allgather"):
            loss_and_grads(model, batches=[batch(seed=0, seq=ORACLE_SEQ // 2)])
    with cpu(), megatron_parallel():
        with pytest.raises(ValueError, match="no attention that takes part in a tiled replay"):
            install(build_gpt(**NO_DROPOUT), cfg)  # Megatron's own DotProductAttention
        model = build_gpt(**NO_DROPOUT, spec=_plugin_spec())
        over = MemoryConfig(recompute_granularity="full", recompute_tiles=2, offload_policy="checkpoint",
                            offload_target="disk", tiled_output_over_input=True)
        handle = install(model, over)
        with pytest.raises(ValueError, match="--longctx-tiled-output-over-input.*extract_layer_indices"):
            model.decoder(hidden_states=None, attention_mask=None, extract_layer_indices={1})
        handle.remove()


def test_tiled_recompute_refuses_what_it_cannot_replay():
    run_ranks(2, _refusals)


def test_output_over_input_needs_tiles_and_the_checkpoint_offload():
    with pytest.raises(ValueError, match="--longctx-tiled-output-over-input.*--longctx-recompute-tiles"):
        MemoryConfig(recompute_granularity="full", offload_policy="checkpoint", tiled_output_over_input=True)
    with pytest.raises(ValueError, match="--longctx-tiled-output-over-input.*--longctx-offload-policy checkpoint"):
        MemoryConfig(recompute_granularity="full", recompute_tiles=4, tiled_output_over_input=True)


def test_recompute_tiles_needs_full_recompute():
    with pytest.raises(ValueError, match="--longctx-recompute-tiles: .*--recompute-granularity full"):
        MemoryConfig(recompute_tiles=2)


def _nvtx_balanced():
    from megatron.core import utils

    from megatron_longctx.megatron.memory_spec import install

    opened = []
    push, pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    torch.cuda.nvtx.range_push = lambda msg: opened.append(msg)
    torch.cuda.nvtx.range_pop = lambda: opened.pop()
    utils.configure_nvtx_profiling(True)
    try:
        with cpu(), megatron_parallel():
            model = build_gpt(**NO_DROPOUT, spec=_plugin_spec())
            handle = install(model, MemoryConfig(recompute_granularity="full", recompute_tiles=3))
            loss_and_grads(model)
            handle.remove()
    finally:
        utils.configure_nvtx_profiling(False)
        torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop = push, pop
    return list(utils._nvtx_range_messages), opened


def test_a_replayed_step_leaves_megatrons_nvtx_stack_balanced():
    """--profile --nvtx-ranges: tiles stopped at the core attention pop the ranges the layer opened."""
    for messages, opened in run_ranks(2, _nvtx_balanced):
        assert messages == [] and opened == []
