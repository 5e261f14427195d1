"""Offloaded tensors read back a range of rows at a time (the input of a layer replayed in sequence tiles).

Disk: each range is read from its file alone (the bytes counted are the rows'), a truncated file is an
error naming the flag, and the file goes with the packed item.  Host: a range comes back through the
side stream in the order the stream contract asks (shown with the recording double).  Tensors that
cannot be served by rows are left to ``save_for_backward``: non-contiguous ones, and any tensor when
another ``saved_tensors_hooks`` is innermost or the first packer cannot serve rows.
"""

import gc
import os

import pytest
import torch

from megatron_longctx.memory import MemoryConfig, hooks
from megatron_longctx.memory.offload import ActivationOffloader
from megatron_longctx.memory.offload_disk import DiskOffloadError
from tests.memory.fake_streams import RecordingOps

TILES = [(0, 5), (5, 12), (12, 16)]
CKPT = dict(recompute_granularity="full", offload_policy="checkpoint")


def _disk(tmp_path):
    return ActivationOffloader(MemoryConfig(**CKPT, offload_target="disk", offload_min_bytes=0,
                                            offload_disk_dir=str(tmp_path)))


def _files(off):
    return [f for f in os.listdir(off.disk_dir) if f.endswith(".bin")]


def _pack(off, x):
    with hooks.packing(off), hooks.layer_scope(0):
        return hooks.pack_rows(x)


def test_disk_rows_come_back_alone_and_the_file_goes_with_the_item(tmp_path):
    off = _disk(tmp_path)
    x = torch.randn(16, 2, 8, dtype=torch.float64)
    item = _pack(off, x)
    assert item is not None and item[0] is off
    off.synchronize()
    files = _files(off)
    assert len(files) == 1 and os.path.getsize(os.path.join(off.disk_dir, files[0])) == x.numel() * 8
    row_bytes = 2 * 8 * 8
    for lo, hi in TILES + TILES[::-1]:
        before = off.stats.fetched_bytes
        rows = hooks.unpack_rows(item, lo, hi)
        assert off.stats.fetched_bytes - before == (hi - lo) * row_bytes  # these rows, not the tensor
        torch.testing.assert_close(rows, x[lo:hi], rtol=0, atol=0)
    assert off.stats.row_fetches == 2 * len(TILES) and off.stats.prefetched_groups == 0
    del item
    gc.collect()
    assert _files(off) == []
    off.close()


def test_a_transposed_batch_of_one_is_served_by_rows(tmp_path):
    # Megatron's embedding output: [b=1, s, h] transposed to [s, 1, h], contiguous but for the size-1 stride
    off = _disk(tmp_path)
    x = torch.randn(1, 16, 4, dtype=torch.float64).transpose(0, 1)
    assert x.is_contiguous() and x.stride() != (4, 4, 1)
    item = _pack(off, x)
    assert item is not None
    for lo, hi in TILES:
        torch.testing.assert_close(hooks.unpack_rows(item, lo, hi), x[lo:hi], rtol=0, atol=0)
    assert off.stats.fetched_bytes == x.numel() * 8 and off.stats.prefetched_groups == 0
    off.close()


def test_a_truncated_file_is_an_error_naming_the_flag(tmp_path):
    off = _disk(tmp_path)
    x = torch.randn(16, 8, dtype=torch.float64)  # 64 bytes a row
    item = _pack(off, x)
    off.synchronize()
    (name,) = _files(off)
    os.truncate(os.path.join(off.disk_dir, name), 10 * 64)  # rows 10.. are gone
    torch.testing.assert_close(hooks.unpack_rows(item, 0, 10), x[:10], rtol=0, atol=0)  # what is left still reads
    with pytest.raises(DiskOffloadError, match="--longctx-offload-disk-dir: .* holds 128 of 512 bytes from byte 512"):
        hooks.unpack_rows(item, 8, 16)
    off.close()


def assert_tiles_come_ahead(log: list, tiles: int) -> None:
    """The order a tile reader must keep (recording double; ``("compute", k)`` marks tile k's compute):
    each tile's rows are copied on the side stream into a side-stream buffer, waiting for no compute; the
    copy of tile k+1 is issued before tile k computes; the compute stream waits only for each tile's own
    copy event, and records its use of the buffer."""
    side_buffers = {e[1] for e in log if e[0] == "empty"}
    assert {e[2] for e in log if e[0] == "empty"} == {"side"}
    copies = [i for i, e in enumerate(log) if e[0] == "copy" and e[1] in side_buffers]
    assert len(copies) == tiles and all(log[i][3] == "side" for i in copies)
    events = [log[i + 1][2] for i in copies]
    assert all(log[i + 1][:2] == ("record_event", "side") for i in copies)
    waits = [e for e in log if e[:2] == ("wait_event", "compute")]
    assert [e[2] for e in waits] == events  # each tile's own copy, in order, nothing else
    computes = [i for i, e in enumerate(log) if e[0] == "compute"]
    for k in range(tiles - 1):
        assert copies[k + 1] < computes[k]  # tile k+1 in flight while tile k computes
    for buf in side_buffers:
        assert ("record_stream", buf, "compute") in log


def _read_tiles(ops, read, x):
    start = len(ops.log)
    for (lo, hi), ahead in zip(TILES, [*TILES[1:], None]):
        torch.testing.assert_close(read(lo, hi, ahead), x[lo:hi], rtol=0, atol=0)
        ops.log.append(("compute", lo))
    return [e for e in ops.log[start:] if e[0] != "free"]


def test_host_rows_come_back_on_the_side_stream_one_tile_ahead():
    ops = RecordingOps()
    off = ActivationOffloader(MemoryConfig(**CKPT, offload_target="host", offload_min_bytes=0), ops=ops)
    x = torch.randn(16, 4, dtype=torch.float64)
    item = _pack(off, x)
    log = _read_tiles(ops, lambda lo, hi, ahead: hooks.unpack_rows(item, lo, hi, ahead), x)
    assert ("wait_stream", "side", "compute") not in log  # copies and compute overlap
    assert_tiles_come_ahead(log, len(TILES))
    assert off.stats.fetched_bytes == 16 * 4 * 8 and off.stats.row_fetches == len(TILES)


def test_disk_rows_are_staged_and_come_back_on_the_side_stream_one_tile_ahead(tmp_path, monkeypatch):
    from megatron_longctx.memory import offload_store

    staged = []
    read = offload_store.read_file
    monkeypatch.setattr(offload_store, "read_file", lambda *a: staged.append(a[3] is not None) or read(*a))
    ops = RecordingOps()
    off = ActivationOffloader(MemoryConfig(**CKPT, offload_target="disk", offload_min_bytes=0,
                                           offload_disk_dir=str(tmp_path)), ops=ops)
    x = torch.randn(16, 4, dtype=torch.float64)
    item = _pack(off, x)
    off.synchronize()
    log = _read_tiles(ops, lambda lo, hi, ahead: hooks.unpack_rows(item, lo, hi, ahead), x)
    assert ("wait_stream", "side", "compute") not in log
    assert_tiles_come_ahead(log, len(TILES))
    assert staged == [True] * len(TILES)  # each range read into a (pinned) staging buffer, not a fresh pageable one
    del item
    off.close()


class _Keeper:
    """A packer that claims every tensor and cannot serve rows."""

    def pack(self, t):
        return t

    def unpack(self, t):
        return t


def test_what_pack_rows_leaves_to_save_for_backward(tmp_path):
    off = _disk(tmp_path)
    x = torch.randn(8, 6, dtype=torch.float64)
    assert hooks.pack_rows(x) is None  # no packer active
    assert _pack(off, x.t()) is None  # not contiguous
    with hooks.packing(off), hooks.packing(_Keeper()), hooks.layer_scope(0):
        assert hooks.pack_rows(x) is None  # the innermost packer may claim it and serves no rows
    with hooks.packing(off), hooks.layer_scope(0):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            assert hooks.pack_rows(x) is None  # another saved_tensors_hooks is innermost
    with hooks.packing(off):
        assert hooks.pack_rows(x) is None  # outside a layer scope the offloader wants nothing
    assert off.stats.offloaded_tensors == 0
    off.close()
