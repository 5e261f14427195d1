"""The accounting helper counts saved activations per layer, and the features lower what stays resident."""

import torch

from megatron_longctx.memory import MemoryConfig, hooks
from megatron_longctx.memory.accounting import PeakMemory, SavedTensorAccountant
from tests.dist import megatron_parallel, run_ranks
from tests.gpt_kit import ORACLE, ORACLE_SEQ, batch, build_gpt, cpu


def test_counts_each_storage_once_and_never_parameters():
    w = torch.nn.Parameter(torch.randn(16, 16, dtype=torch.float64))
    x = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    with SavedTensorAccountant(torch.nn.ModuleList()) as acc:
        acc._params.add(w.untyped_storage().data_ptr())
        with hooks.layer_scope(0):
            y = torch.tanh(x @ w)  # saves x, w (parameter), tanh output
            z = y * y.t()  # saves y twice (a view): counted once
        with hooks.layer_scope(1), hooks.module_scope("mlp"):
            out = (z.exp()).sum()  # saves exp output
    assert acc.saved.resident == {(0, None): 2 * 16 * 16 * 8, (1, "mlp"): 16 * 16 * 8}
    assert acc.saved.per_layer() == {0: 2 * 16 * 16 * 8, 1: 16 * 16 * 8}
    out.backward()
    assert x.grad is not None


def test_peak_memory_sees_an_allocation():
    with PeakMemory(torch.device("cpu")) as peak:
        big = torch.ones(64, 1024, 1024, dtype=torch.uint8)  # 64 MiB, touched
        big += 1
        del big
    # the sampler may miss the very top; the start is the RSS before the block (~500 MiB here), not 0
    assert 32 << 20 <= peak.added_bytes <= 96 << 20, peak.added_bytes
    with PeakMemory(torch.device("cpu")) as idle:
        pass
    assert idle.added_bytes < 8 << 20, idle.added_bytes  # measured 4 KiB


def _features_lower_resident_bytes():
    from megatron_longctx.megatron.memory_spec import install

    def resident(cfg):
        model = build_gpt(**{**ORACLE, "dropout": 0.0})
        handle = install(model, cfg) if cfg is not None else None
        b = batch(seq=ORACLE_SEQ)
        tokens, pos = b["tokens"], b["position_ids"]
        with SavedTensorAccountant(model) as acc:
            loss = model(tokens, pos, None, labels=tokens).sum()
        loss.backward()
        if handle is not None:
            handle.remove()
        return acc.saved

    with cpu(), megatron_parallel(tp=2):
        base = resident(None)
        ckpt = resident(MemoryConfig(recompute_granularity="full", offload_policy="checkpoint", offload_target="disk",
                                     offload_min_bytes=0))
        tiled = resident(MemoryConfig(tiled_mlp_tiles=4, tiled_loss_tiles=4))
        norms = resident(MemoryConfig(recompute_granularity="selective", recompute_modules=("layernorm",)))
        mlp = resident(MemoryConfig(recompute_granularity="selective", recompute_modules=("mlp",)))
    assert set(base.per_layer()) == {None, 0, 1}
    # checkpoint offload: the layers keep nothing resident, their inputs went to disk
    assert ckpt.per_layer().get(0, 0) == 0 and ckpt.offloaded_total > 0
    assert ckpt.resident_total < base.resident_total
    assert tiled.resident_total < base.resident_total
    # selective recompute: the norm outputs (two [s, b, h] per layer) are no longer stored ...
    s, b, h = 32, 2, 32
    assert base.per_layer()[0] - norms.per_layer()[0] == 2 * s * b * h * 8
    # ... and the MLP keeps only its input instead of its ffn-sized intermediates
    assert mlp.per_layer()[0] < base.per_layer()[0] - s * b * 64 // 2 * 8


def test_features_lower_resident_saved_bytes():
    run_ranks(2, _features_lower_resident_bytes)


def test_peak_rss_is_the_high_water_mark_and_resets():
    from megatron_longctx.memory.accounting import peak_rss_bytes, rss_bytes

    peak_rss_bytes(reset=True)
    held = bytearray(300 << 20)  # touched: resident
    del held
    peak = peak_rss_bytes(reset=True)
    assert peak >= rss_bytes() + (250 << 20), peak  # the 300 MiB are gone, the peak still holds them
    assert peak_rss_bytes() < peak - (250 << 20)  # a new window starts from what is resident now
