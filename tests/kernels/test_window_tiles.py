"""Sliding windows in linear time: banded blocks as row tiles, against float64 and by counted work.

A block cut by both edges of a band (a sliding window's diagonal block) reaches the kernels as row
tiles trimmed to the keys their rows see (:func:`driver.band_tiles`); ``cpu_flash`` serves each tile
with unmasked and causal calls only.  Parity runs every block a zigzag layout makes (chunk ``i`` of
queries against chunk ``j`` of keys) with tile sizes shrunk so that blocks of tens of rows cut into
many tiles; the cost tests count the pairs and mask elements each op call is handed at full tile size.
"""

import inspect

import pytest
import torch

from megatron_longctx.kernels import BlockArgs, BlockMask, cpu_flash, driver, reference
from tests.oracle import attention, visible

BACKENDS = {"cpu_flash": cpu_flash, "reference": reference}
CHUNK = 40  # zigzag chunk: blocks are chunk i of queries against chunk j of keys
# (left, right) under causal=True (right ignored) and causal=False; widths across the shrunk tiles
# below: narrower than a masked tile, between, equal to a chunk, past a chunk, past two.
WINDOWS = [(True, (3, 0)), (True, (9, 0)), (True, (39, 0)), (True, (40, 0)), (True, (57, 0)),
           (True, (100, 0)), (False, (13, 5)), (False, (2, 30)), (False, (50, 61))]


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(driver, "BAND_TILE_ROWS", 16)
    monkeypatch.setattr(driver, "MASKED_TILE_ROWS", 6)


def _inputs(s_q, s_k, h_q=4, h_kv=2, d_qk=8, d_v=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in (
        (1, s_q, h_q, d_qk), (1, s_k, h_kv, d_qk), (1, s_k, h_kv, d_v), (1, s_q, h_q, d_v)))
    return q, k, v, dout


def _check_block(kernel, causal, window, q_start, k_start, s_q, s_k, **shape):
    q, k, v, dout = _inputs(s_q, s_k, **shape)
    scale = 0.3
    args = BlockArgs(scale, BlockMask(causal=causal, window=window), q_start, k_start)
    seen = visible(torch.arange(q_start, q_start + s_q), torch.arange(k_start, k_start + s_k), causal, window)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    want_out, want_lse = attention(qr, kr, vr, scale, seen)
    want_out.backward(dout)

    out, lse = kernel.forward(q, k, v, args)
    torch.testing.assert_close(out, want_out.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse.detach(), rtol=1e-10, atol=1e-10)
    grads = kernel.backward(dout, q, k, v, out, lse, args)
    for got, want in zip(grads, (qr.grad, kr.grad, vr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("causal,window", WINDOWS, ids=lambda x: str(x))
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_zigzag_blocks_match_float64(small_tiles, backend, causal, window):
    """Every (query chunk, key chunk) block of a 2·cp = 4 chunk sequence, GQA, against the oracle."""
    for i in range(4):
        for j in range(4):
            _check_block(BACKENDS[backend], causal, window, i * CHUNK, j * CHUNK, CHUNK, CHUNK)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_tiles_at_production_size_match_float64(backend):
    """Production tile sizes on a 2,500-row diagonal block: 1,024-row tiles (w = 1,500), 699-row
    tiles (w = 700), 128-row masked tiles (w = 40); MLA head dims (d_qk != d_v)."""
    for window in ((1500, 0), (700, 0), (40, 0)):
        _check_block(BACKENDS[backend], True, window, 0, 0, 2500, 2500, h_q=2, h_kv=1, d_qk=12, d_v=8)


class _Counter:
    """Wraps the CPU op: pairs (rows x keys) and additive-mask elements of every call."""

    def __init__(self, monkeypatch):
        self.pairs, self.mask_elements, self.calls = 0, 0, 0
        for name in ("_op_forward", "_op_backward"):
            monkeypatch.setattr(cpu_flash, name, self._wrap(getattr(cpu_flash, name)))

    def _wrap(self, op):
        signature = inspect.signature(op)

        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            self.calls += 1
            self.pairs += bound["q"].shape[1] * bound["k"].shape[1]
            self.mask_elements += 0 if bound.get("mask") is None else bound["mask"].numel()
            return op(*args, **kwargs)

        return counted


def _run_counted(monkeypatch, s, mask, q_start=0, k_start=0):
    counter = _Counter(monkeypatch)
    q, k, v, dout = (t.float() for t in _inputs(s, s, h_q=2, h_kv=1, d_qk=16, d_v=16))
    args = BlockArgs(0.25, mask, q_start, k_start)
    out, lse = cpu_flash.forward(q, k, v, args)
    forward = (counter.pairs, counter.mask_elements)
    cpu_flash.backward(dout, q, k, v, out, lse, args)
    return forward, (counter.pairs - forward[0], counter.mask_elements - forward[1])


@pytest.mark.parametrize("w", [300, 1100, 3000])
def test_windowed_block_scores_linear_pairs_without_masks(monkeypatch, w):
    """A windowed 4K diagonal block: pairs handed to the op <= (w + tile) * s, forward and backward,
    no mask at all (each tile is a reversed-causal, an unmasked and a causal call)."""
    s = 4096
    tile = min(driver.BAND_TILE_ROWS, w)  # rows per tile: narrower than the band (w + 1 keys)
    for pairs, mask_elements in _run_counted(monkeypatch, s, BlockMask(causal=True, window=(w, 0))):
        assert pairs <= (w + tile) * s, (pairs, (w + tile) * s)
        assert mask_elements == 0


def test_narrow_window_masks_bounded_tiles(monkeypatch):
    """A band narrower than a masked tile: masks of at most tile x (tile + w) per tile, linear in s."""
    s, w, tile = 4096, 20, driver.MASKED_TILE_ROWS
    for pairs, mask_elements in _run_counted(monkeypatch, s, BlockMask(causal=True, window=(w, 0))):
        assert pairs <= (w + 1 + tile) * s
        assert mask_elements <= (w + 1 + tile) * s


@pytest.mark.parametrize("q_start,desc", [(0, "causal diagonal"), (2048, "full off-diagonal")])
def test_causal_and_full_blocks_take_no_mask(monkeypatch, q_start, desc):
    (pairs, mask_elements), _ = _run_counted(monkeypatch, 2048, BlockMask(causal=True), q_start=q_start)
    assert mask_elements == 0, desc
    assert pairs == 2048 * 2048, desc  # one call over the block: no tiling without a window


def test_reference_scores_only_the_band(monkeypatch):
    """The float64 reference under a window scores tiles of the band, not the block."""
    scored = []
    real = reference._scores
    monkeypatch.setattr(reference, "_scores", lambda q, k, args: scored.append(q.shape[1] * k.shape[1]) or real(q, k, args))
    s, w = 4096, 256
    q, k, v, dout = _inputs(s, s, h_q=1, h_kv=1)
    args = BlockArgs(0.25, BlockMask(causal=True, window=(w, 0)), 0, 0)
    out, lse = reference.forward(q, k, v, args)
    reference.backward(dout, q, k, v, out, lse, args)
    assert sum(scored) <= 2 * (w + w) * s
