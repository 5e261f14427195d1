"""Tiled MLP and tiled logits+loss give Megatron's loss and gradients (TP=2, sequence parallel, CP=2).

Oracles: Megatron's ``output_layer`` + ``vocab_parallel_cross_entropy`` and the untiled MLP, float64.
"""

import pytest
import torch

from megatron_longctx.memory import MemoryConfig
from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import (
    ORACLE,
    ORACLE_SEQ,
    assert_same,
    batch,
    build_gpt,
    cpu,
    loss_and_grads,
)


def _loss_matches_vocab_parallel_cross_entropy():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from megatron_longctx.memory.tiled_loss import TiledLossArgs, tiled_logits_loss

    with cpu(), megatron_parallel(tp=2):
        tp = parallel_state.get_tensor_model_parallel_group()
        rank = parallel_state.get_tensor_model_parallel_rank()
        s, b, h, vocab = 13, 2, 8, 20
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(s, b, h, dtype=torch.float64, generator=g)
        full_weight = torch.randn(vocab, h, dtype=torch.float64, generator=g)
        weight = full_weight[rank * 10:(rank + 1) * 10]
        labels = torch.randint(0, vocab, (b, s), generator=g)
        grad_out = torch.rand(b, s, dtype=torch.float64, generator=g)

        def run(tiled, num_tiles=4, recompute=False):
            x = hidden.clone().requires_grad_()
            w = weight.clone().requires_grad_()
            if tiled:
                loss = tiled_logits_loss(x, w, labels, TiledLossArgs(num_tiles, tp, recompute=recompute))  # [b, s]
            else:
                logits = copy_to_tensor_model_parallel_region(x) @ w.t()  # [s, b, V/tp]
                loss = vocab_parallel_cross_entropy(logits, labels.t().contiguous()).t()  # [b, s]
            (loss * grad_out).sum().backward()
            return loss.detach(), {"hidden": x.grad, "weight": w.grad}

        # float64 oracle: plain softmax cross-entropy over the whole vocabulary
        x = hidden.clone().requires_grad_()
        w = full_weight.clone().requires_grad_()
        loss = torch.nn.functional.cross_entropy((x @ w.t()).reshape(s * b, vocab), labels.t().reshape(-1),
                                                 reduction="none").view(s, b).t()  # [b, s]
        (loss * grad_out).sum().backward()
        exact = (loss.detach(), {"hidden": x.grad, "weight": w.grad[rank * 10:(rank + 1) * 10]})
        megatron = run(False)  # Megatron computes the loss in float32 whatever the input dtype
        for tiles in (1, 4, 13, 20):
            for recompute in (False, True):
                ours = run(True, tiles, recompute)
                assert_same(exact, ours)
                assert_same(megatron, (ours[0].float(), ours[1]), rtol=1e-5, atol=1e-6)
        # sequence parallel: each rank holds [s/tp] tokens; Megatron's gather reduce-scatters d hidden,
        # so the tiled loss must not all-reduce it as well (reduce_grad_input=False)
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        hidden_sp = torch.cat([hidden, hidden[:1]])  # [s_pad, b, h]
        labels_sp = torch.cat([labels, labels[:, :1]], dim=1)  # [b, s_pad]
        grad_sp = torch.cat([grad_out, torch.zeros(b, 1, dtype=torch.float64)], dim=1)
        full_grad = torch.cat([exact[1]["hidden"], torch.zeros(1, b, h, dtype=torch.float64)])
        for recompute in (False, True):
            local = hidden_sp[rank * 7:(rank + 1) * 7].clone().requires_grad_()  # [s_pad/tp, b, h]
            w = weight.clone().requires_grad_()
            loss = tiled_logits_loss(gather_from_sequence_parallel_region(local, group=tp), w, labels_sp,
                                     TiledLossArgs(3, tp, reduce_grad_input=False, recompute=recompute))  # [b, s_pad]
            (loss * grad_sp).sum().backward()
            torch.testing.assert_close(loss[:, :s], exact[0])
            torch.testing.assert_close(local.grad, full_grad[rank * 7:(rank + 1) * 7])
            torch.testing.assert_close(w.grad, exact[1]["weight"])


def test_tiled_loss_matches_vocab_parallel_cross_entropy_tp2():
    run_ranks(2, _loss_matches_vocab_parallel_cross_entropy)


def _float64_oracle(hidden, weight, labels, grad_out):
    x = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    s, b, _ = hidden.shape
    loss = torch.nn.functional.cross_entropy((x @ w.t()).reshape(s * b, -1), labels.t().reshape(-1),
                                             reduction="none").view(s, b).t()  # [b, s]
    (loss * grad_out).sum().backward()
    return loss.detach(), {"hidden": x.grad, "weight": w.grad}


def test_tiled_loss_backward_in_forward_any_incoming_gradient():
    """The uniform-gradient path, masked tokens (corrected in backward) and an arbitrary gradient, vs float64."""
    from megatron_longctx.memory.tiled_loss import TiledLossArgs, tiled_logits_loss

    g = torch.Generator().manual_seed(1)
    s, b, h, vocab = 11, 2, 6, 17
    hidden = torch.randn(s, b, h, dtype=torch.float64, generator=g)
    weight = torch.randn(vocab, h, dtype=torch.float64, generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.float64)
    mask[0, :3] = 0
    mask[1, 7] = 0
    for grad_out in (torch.full((b, s), 0.25, dtype=torch.float64), mask / mask.sum(),
                     torch.rand(b, s, dtype=torch.float64, generator=g)):
        exact = _float64_oracle(hidden, weight, labels, grad_out)
        for tiles in (1, 3, 11):
            x = hidden.clone().requires_grad_()
            w = weight.clone().requires_grad_()
            loss = tiled_logits_loss(x, w, labels, TiledLossArgs(tiles))
            (loss * grad_out).sum().backward(retain_graph=True)
            assert_same(exact, (loss.detach(), {"hidden": x.grad, "weight": w.grad}))
            with pytest.raises(RuntimeError, match="retain_graph"):
                (loss * grad_out).sum().backward()
    # float32: Megatron's precision, against the same float64 oracle
    x, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    loss = tiled_logits_loss(x, w, labels, TiledLossArgs(4))
    (loss * (mask / mask.sum()).float()).sum().backward()
    exact = _float64_oracle(hidden, weight, labels, mask / mask.sum())
    # measured: loss 7.4e-7 (loss <= 10.9), d hidden 2.2e-8 (<= 0.19), d weight 4.1e-8 (<= 0.24)
    torch.testing.assert_close(loss.double(), exact[0], rtol=0, atol=2.2e-6)
    torch.testing.assert_close(x.grad.double(), exact[1]["hidden"], rtol=0, atol=6.5e-8)
    torch.testing.assert_close(w.grad.double(), exact[1]["weight"], rtol=0, atol=1.2e-7)


def _tile_inputs(seed):
    """hidden [64, 1, 8], weight [4096, 8] (float64), labels and a mask whose last 24 tokens are 0."""
    g = torch.Generator().manual_seed(seed)
    s, b, h, vocab = 64, 1, 8, 4096
    hidden = torch.randn(s, b, h, dtype=torch.float64, generator=g)
    weight = torch.randn(vocab, h, dtype=torch.float64, generator=g) / 4
    labels = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.float64)
    mask[0, 40:] = 0
    return g, hidden, weight, labels, mask


def test_tiled_loss_holds_one_logits_tile_at_a_time():
    """Peak bytes the tiled loss creates, forward and backward (masked tokens corrected): one logits tile."""
    from megatron_longctx.bench.live_memory import LiveTensors
    from megatron_longctx.memory.tiled_loss import TiledLossArgs, tiled_logits_loss

    _, hidden, weight, labels, mask = _tile_inputs(2)  # a whole tile of masked tokens: corrected in backward
    (s, b, h), vocab, tiles = hidden.shape, weight.shape[0], 4
    grad_out = mask / mask.sum()
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    tile = s // tiles * b * vocab * 8  # one [s/tiles, b, V] float64 logits tile
    with LiveTensors() as live:
        held = (x.view_as(x), w.view_as(w))  # the inputs' storages are counted from here on, outside the peaks
        start = live.peak = live.live
        loss = tiled_logits_loss(x, w, labels, TiledLossArgs(tiles))
        forward_peak = live.peak - start
        live.peak = live.live
        (loss * grad_out).sum().backward()
        backward_peak = live.peak - start
        del held
    kept = vocab * h * 8 + s * b * h * 8  # D^T h [V, h] and D @ W [s, b, h], kept for backward
    assert forward_peak <= kept + tile + tile // 8, (forward_peak, kept, tile)  # two tiles at once before
    assert backward_peak <= kept + tile + tile // 8, (backward_peak, kept, tile)
    exact = _float64_oracle(hidden, weight, labels, grad_out)
    assert_same(exact, (loss.detach(), {"hidden": x.grad, "weight": w.grad}))


def test_tiled_loss_recompute_any_incoming_gradient_and_memory():
    """--longctx-tiled-loss-recompute: the same loss and gradients as float64 for any incoming gradient, a
    second backward allowed; forward holds one logits tile and [s, b] statistics, nothing [s, b, h] or [V, h]."""
    from megatron_longctx.bench.live_memory import LiveTensors
    from megatron_longctx.memory.tiled_loss import TiledLossArgs, tiled_logits_loss

    g, hidden, weight, labels, mask = _tile_inputs(4)
    (s, b, h), vocab, tiles = hidden.shape, weight.shape[0], 4
    tile = s // tiles * b * vocab * 8  # one [s/tiles, b, V] float64 logits tile
    for grad_out in (mask / mask.sum(), torch.rand(b, s, dtype=torch.float64, generator=g)):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with LiveTensors() as live:
            held = (x.view_as(x), w.view_as(w))
            start = live.peak = live.live
            loss = tiled_logits_loss(x, w, labels, TiledLossArgs(tiles, recompute=True))
            forward_peak = live.peak - start
            forward_kept = live.live - start
            live.peak = live.live
            (loss * grad_out).sum().backward(retain_graph=True)
            backward_peak = live.peak - start
            del held
        stats = 3 * s * b * 8  # loss, lse (float64 here) and the [s, b] target
        assert forward_kept <= stats, forward_kept  # the fused path keeps [V, h] + [s, b, h] more
        assert forward_peak <= stats + tile + tile // 8, (forward_peak, tile)
        grads = vocab * h * 8 + s * b * h * 8  # the weight's and the hidden states' gradients
        assert backward_peak <= forward_kept + grads + tile + tile // 8, (backward_peak, grads, tile)
        exact = _float64_oracle(hidden, weight, labels, grad_out)
        assert_same(exact, (loss.detach(), {"hidden": x.grad, "weight": w.grad}))
        x.grad = w.grad = None
        (loss * grad_out).sum().backward()  # nothing was scaled in place: a second backward is the same
        assert_same(exact, (loss.detach(), {"hidden": x.grad, "weight": w.grad}))


def test_tiled_loss_recompute_accumulates_into_megatron_main_grad():
    """An untied output weight under Megatron's DDP: d W is added into main_grad (kept from earlier
    microbatches), grad_added_to_main_grad is set, and no [V, h] buffer of the loss's own is made."""
    from megatron_longctx.bench.live_memory import LiveTensors
    from megatron_longctx.memory.tiled_loss import TiledLossArgs, tiled_logits_loss

    g = torch.Generator().manual_seed(5)
    s, b, h, vocab = 48, 2, 8, 2048
    hidden = torch.randn(s, b, h, dtype=torch.float64, generator=g)
    weight = torch.randn(vocab, h, dtype=torch.float64, generator=g) / 4
    labels = torch.randint(0, vocab, (b, s), generator=g)
    grad_out = torch.rand(b, s, dtype=torch.float64, generator=g)
    exact = _float64_oracle(hidden.float().double(), weight.float().double(), labels, grad_out)
    x = hidden.float().requires_grad_()
    w = torch.nn.Parameter(weight.float())
    earlier = torch.randn(vocab, h, generator=g) / 64  # what earlier microbatches accumulated
    w.main_grad = earlier.clone()
    w.grad_added_to_main_grad = False
    loss = tiled_logits_loss(x, w, labels, TiledLossArgs(3, recompute=True, into_main_grad=True))
    with LiveTensors() as live:
        held = (x.view_as(x), w.view_as(w), w.main_grad.view_as(w))  # counted from here on, outside the peak
        start = live.peak = live.live
        (loss * grad_out.float()).sum().backward()
        backward_peak = live.peak - start
        del held
    tile = s // 3 * b * vocab * 4
    # d hidden, a placeholder weight gradient that is never written (Megatron's) and one logits tile; a
    # float32 accumulator of the loss's own would be one more [V, h]
    assert backward_peak <= s * b * h * 4 + vocab * h * 4 + tile + vocab * h * 2, backward_peak
    assert w.grad_added_to_main_grad is True
    # measured: d W 7.5e-7 (<= 2.9, added to main_grad in float32), d hidden 7.3e-7 (<= 0.56)
    torch.testing.assert_close(w.main_grad.double() - earlier.double(), exact[1]["weight"], rtol=0, atol=2.2e-6)
    torch.testing.assert_close(x.grad.double(), exact[1]["hidden"], rtol=0, atol=2.2e-6)
    # without the flag Megatron's hook adds the returned gradient: it is returned, main_grad untouched
    w2 = torch.nn.Parameter(weight.float())
    w2.main_grad = earlier.clone()
    args = TiledLossArgs(3, recompute=True, into_main_grad=True)
    tiled_logits_loss(hidden.float(), w2, labels, args).sum().backward()
    torch.testing.assert_close(w2.main_grad, earlier)
    exact = _float64_oracle(hidden.float().double(), weight.float().double(), labels, torch.ones(b, s, dtype=torch.float64))
    torch.testing.assert_close(w2.grad.double(), exact[1]["weight"], rtol=0, atol=2.7e-6)  # measured 9.0e-7


def test_tiled_loss_in_bf16_holds_a_float32_tile_and_its_bf16_copy():
    """bf16 hidden and weight: logits, D and D^T h in float32; D^T h is made from the float32 D (no second
    float32 copy of a tile), D @ W from a bf16 copy of it."""
    from megatron_longctx.bench.live_memory import LiveTensors
    from megatron_longctx.memory.tiled_loss import TiledLossArgs, tiled_logits_loss

    g = torch.Generator().manual_seed(3)
    s, b, h, vocab, tiles = 64, 1, 8, 4096, 4
    hidden = torch.randn(s, b, h, dtype=torch.float64, generator=g)
    weight = torch.randn(vocab, h, dtype=torch.float64, generator=g) / 4
    labels = torch.randint(0, vocab, (b, s), generator=g)
    x, w = hidden.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    tile = s // tiles * b * vocab * 4  # one [s/tiles, b, V] float32 logits tile
    with LiveTensors() as live:
        held = (x.view_as(x), w.view_as(w))
        start = live.peak = live.live
        loss = tiled_logits_loss(x, w, labels, TiledLossArgs(tiles))
        forward_peak = live.peak - start
        del held
    kept = vocab * h * 4 + s * b * h * 2  # D^T h [V, h] float32 and D @ W [s, b, h] bf16
    assert forward_peak <= kept + tile + tile // 2 + tile // 8, (forward_peak, kept, tile)
    loss.sum().backward()
    # oracle: float64 on the bf16 inputs, the logits rounded to bf16 as a bf16 matmul returns them (Megatron's
    # output layer does the same); the rounding is straight-through, so the gradients are float64's
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    logits = xd @ wd.t()  # [s, b, V]
    logits = logits + (logits.detach().bfloat16().double() - logits.detach())
    want = torch.nn.functional.cross_entropy(logits.reshape(s * b, vocab), labels.t().reshape(-1),
                                             reduction="none").view(s, b).t()  # [b, s], ~10
    want.sum().backward()
    # measured: loss 7.5e-7 (float32 softmax; a bf16 sum of exponentials makes it 3.4e-3), d hidden 2.1e-3
    # (|d hidden| <= 0.76, returned in bf16), d weight 7.0e-3 (|d weight| <= 3.1, returned in bf16)
    torch.testing.assert_close(loss.double(), want.detach(), rtol=0, atol=2.2e-6)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=0, atol=6e-3)
    torch.testing.assert_close(w.grad.double(), wd.grad, rtol=0, atol=2e-2)


def _gpt_tiled_matches_plain():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_longctx.megatron.memory_spec import apply_memory_to_layer_spec, install
    from megatron_longctx.megatron.tiled_mlp import tiled_mlp_type

    extra: dict = {}  # sequence parallel needs TE/Apex norms: not buildable on CPU
    with cpu(), megatron_parallel(tp=2):
        plain = build_gpt(**ORACLE, **extra)
        ref = loss_and_grads(plain)
        # spec route: TiledMLP built from the layer spec, same state_dict keys and values
        spec = apply_memory_to_layer_spec(get_gpt_layer_local_spec(), MemoryConfig(tiled_mlp_tiles=3))
        model = build_gpt(**ORACLE, spec=spec, **extra)
        assert isinstance(model.decoder.layers[0].mlp, tiled_mlp_type())
        assert model.state_dict().keys() == plain.state_dict().keys()
        for key, value in plain.state_dict().items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(model.state_dict()[key], value, msg=key)
        handle = install(model, MemoryConfig(tiled_mlp_tiles=3, tiled_loss_tiles=5))  # MLP already tiled: kept
        # Megatron's cross-entropy runs in float32, ours in the model's float64
        assert_same(ref, loss_and_grads(model), rtol=1e-5, atol=1e-7)
        handle.remove()
        # module-wrapper route on a plain model, with full recompute on top
        model = build_gpt(**ORACLE, **extra)
        handle = install(model, MemoryConfig(tiled_mlp_tiles=4, tiled_loss_tiles=3, recompute_granularity="full"))
        assert_same(ref, loss_and_grads(model), rtol=1e-5, atol=1e-7)
        handle.remove()
        handle = install(model, MemoryConfig(tiled_loss_tiles=3, tiled_loss_recompute=True))
        assert_same(ref, loss_and_grads(model), rtol=1e-5, atol=1e-7)
        b = batch(seq=ORACLE_SEQ)
        tokens, position_ids = b["tokens"], b["position_ids"]
        logits = model(tokens, position_ids, None)  # no labels: Megatron's logits path, untouched
        assert logits.shape == (tokens.shape[0], tokens.shape[1], 32)  # this TP rank's vocabulary shard
        handle.remove()


def test_gpt_tiled_mlp_and_loss_match_plain_tp2():
    run_ranks(2, _gpt_tiled_matches_plain)


def test_tiled_mlp_tiles_a_forward_without_grad():
    """Full recompute's first forward runs without grad: it is tiled too (one MLP call per tile), same output."""
    from megatron_longctx.memory.tiled_mlp import tiled_mlp

    torch.manual_seed(0)
    w1, w2 = torch.randn(16, 64, dtype=torch.float64), torch.randn(64, 16, dtype=torch.float64)
    seen = []

    def mlp(x):  # [t, b, h] -> ([t, b, h], None)
        seen.append(x.shape[0])
        return torch.nn.functional.silu(x @ w1) @ w2, None

    x = torch.randn(10, 2, 16, dtype=torch.float64)
    expected, _ = mlp(x)
    seen.clear()
    with torch.no_grad():
        out, bias = tiled_mlp(mlp, x, num_tiles=4)
    assert seen == [3, 3, 2, 2] and bias is None
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("create_graph", [False, True], ids=["backward", "create-graph"])
def test_tiled_mlp_input_and_weight_gradients_match_float64(create_graph):
    """d x gathers every tile's gradient into its rows, also under an outer ``create_graph`` backward; the
    weights' ``.grad`` sums the tiles."""
    from megatron_longctx.memory.tiled_mlp import tiled_mlp

    gen = torch.Generator().manual_seed(3)
    w1, w2 = (torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_() for shape in ((16, 48), (48, 16)))
    x, g = (torch.randn(11, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))

    def mlp(t):  # [t, b, h] -> ([t, b, h], None)
        return torch.nn.functional.silu(t @ w1) @ w2, None

    want = torch.autograd.grad(mlp(x.requires_grad_())[0], (x, w1, w2), g)
    x.grad = None
    tiled = x.detach().requires_grad_()
    out, _ = tiled_mlp(mlp, tiled * 1, num_tiles=4)  # a non-leaf input, as a layer's hidden states
    out.backward(g, create_graph=create_graph)
    for got, ref in zip((tiled.grad, w1.grad, w2.grad), want):
        torch.testing.assert_close(got.detach(), ref)
