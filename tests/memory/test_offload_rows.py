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


def test_host_rows_come_back_through_the_side_stream():
    ops = RecordingOps()
    off = ActivationOffloader(MemoryConfig(**CKPT, offload_target="host", offload_min_bytes=0),
                              ops=ops)
    x = torch.randn(16, 4, dtype=torch.float64)
    item = _pack(off, x)
    (copied,) = [e[2] for e in ops.log if e[:2] == ("record_event", "side")]
    start = len(ops.log)
    rows = hooks.unpack_rows(item, 5, 12)
    back = [e for e in ops.log[start:] if e[0] != "free"]
    buf = back[0][1]
    assert back[0] == ("empty", buf, "compute")  # a compute-stream allocation, like the tensor autograd kept
    assert back[1] == ("wait_stream", "side", "compute")
    assert back[2] == ("wait_event", "side", copied)  # the copy off the device has landed
    assert back[3][:2] == ("copy", buf) and back[3][3] == "side"  # the pool buffer is read on the side stream
    fetched = back[4][2]
    assert back[4][:2] == ("record_event", "side") and back[5] == ("record_stream", buf, "side")
    assert back[6] == ("wait_event", "compute", fetched)  # before the caller reads it
    torch.testing.assert_close(rows, x[5:12], rtol=0, atol=0)
    assert off.stats.fetched_bytes == 7 * 4 * 8


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
