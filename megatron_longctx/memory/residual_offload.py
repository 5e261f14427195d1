"""The residual stream's gradient kept off the device between the plugin's tiled backwards.

A layer replayed in tiles (:mod:`tiled_recompute`) and the recomputing tiled loss (:mod:`tiled_loss`)
read their output's gradient and write their input's gradient one tile of rows at a time.  Between two
such backwards the whole ``[s, b, h]`` gradient would sit on the device, beside the next layer's
gathered K/V and dK/dV.  With ``--longctx-offload-residual-grad`` it stays on the offload target
instead (:class:`ResidualGradOffload`: pinned host memory, or an unlinked file under the disk offload's run
directory), and only a tile of it is on the device at a time.

With the activation offloader at hand (:class:`Target` ``offloader``) the host buffer is a buffer of its
pool (counted against ``--longctx-offload-host-pool-bytes``; past that bound the gradient stays on the
device) and the rows travel on its side stream under its stream contract (:mod:`.streams`): a tile
goes to the host once the compute stream has made it, without the compute stream waiting, and the
next tile's rows come to the device while the current tile computes (double buffered).

Autograd still needs a gradient tensor between the two nodes.  The producer hands the stream to the
consumer node itself (:func:`hand_over`; the consumer is known at forward: the autograd node of the
producer's input, which must be a plugin backward that reads streams, see :func:`consumer_of`) and
returns a zero tensor of the right shape that holds no memory (a broadcast scalar).  If autograd adds
another gradient to it (the input had a second consumer), the consumer receives that sum and adds it
to the stream's rows: the gradient stays exact either way.  What cannot see the streamed gradient is a
reader of the input's gradient outside autograd's graph walk (``torch.autograd.grad(..., inputs=x)`` on
an intermediate residual tensor); a tensor hook, ``retain_grad`` or a leaf input turns streaming off
for that tensor (:class:`grad_buffers.Watch`).
"""

from __future__ import annotations

import math
import os
import tempfile
import weakref
from typing import Any, Optional

import torch

from megatron_longctx.memory import grad_buffers
from megatron_longctx.memory.offload_disk import disk_error

FLAG = "--longctx-offload-residual-grad"
_STREAMS = "_longctx_grad_streams"  # on a consumer node: {output slot: ResidualGradOffload}
_ZERO = "_longctx_streamed_zero"  # on the zero gradient a producer returns in place of the streamed one
_READS_STREAMS = "_longctx_reads_grad_streams"  # on an autograd Function whose backward reads streams


class ResidualGradOffload:
    """A ``[s, ...]`` gradient on the offload target, read and written a row range at a time.

    ``disk_dir``: an unlinked file there (its space is freed when the stream is); else host memory: with
    ``offloader`` (a device gradient) a buffer of its host pool, moved on its side stream; without, host
    memory of its own, pinned when CUDA is available.  With ``offloader``, file rows are staged through
    pinned memory: written rows go to the host on its side stream and to the file on its I/O worker (a
    read of those rows waits for that write), rows read come to the device on its side stream.
    """

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                 disk_dir: Optional[str] = None, offloader: Any = None) -> None:
        self.shape, self.dtype, self.device = torch.Size(shape), dtype, device
        self.row_bytes = math.prod(self.shape[1:]) * torch.empty((), dtype=dtype).element_size()
        self._fd: Optional[int] = None
        self._host: Optional[torch.Tensor] = None
        self._dense: Optional[torch.Tensor] = None  # past the pool's bound: the gradient stays on the device
        self._off = None  # the offloader whose side stream moves the rows
        self._stats = None if offloader is None else offloader.stats  # rows moved are counted there
        self._ahead: Optional[tuple] = None  # ((lo, hi), buffer, event): the next rows, on their way
        self._writes: list = []  # (lo, hi, future): rows on their way to the file (I/O worker)
        self.path = disk_dir
        if offloader is not None and offloader.ops.is_device(torch.empty(0, device=device)):
            self._off = offloader
        if disk_dir is not None:
            fd = None
            try:
                fd, self.path = tempfile.mkstemp(prefix="grad-", suffix=".bin", dir=disk_dir)
                os.unlink(self.path)
                os.ftruncate(fd, self.shape[0] * self.row_bytes)
            except OSError as exc:
                if fd is not None:
                    os.close(fd)
                raise disk_error("creating the residual gradient's file", self.path, exc) from exc
            self._fd = fd
            weakref.finalize(self, os.close, fd)
        elif self._off is not None:
            nbytes = self.shape[0] * self.row_bytes
            buf = offloader.pool.take(nbytes)  # [nbytes] uint8
            if buf is None:
                self._dense = torch.empty(self.shape, dtype=dtype, device=device)
                offloader.stats.kept_over_bound_bytes += nbytes
            else:
                self._host = buf.view(dtype).view(self.shape)
                # later users of a pool buffer order themselves on the same side stream
                weakref.finalize(self, offloader.pool.give, buf)
        else:
            pin = torch.cuda.is_available() and device.type == "cuda"
            self._host = torch.empty(self.shape, dtype=dtype, pin_memory=pin)

    def read(self, lo: int, hi: int, ahead: Optional[tuple] = None) -> torch.Tensor:
        """Rows ``[lo, hi)`` on the device (a new tensor: the caller may write into it).  ``ahead``: the rows
        ``(lo, hi)`` read next; on the offloader's side stream their copy starts now."""
        if self._dense is not None:
            return self._dense[lo:hi].clone()
        if self._off is not None:
            got, self._ahead = self._ahead, None
            buf, event = got[1:] if got is not None and got[0] == (lo, hi) else self._to_device(lo, hi)
            if ahead is not None:
                self._ahead = (tuple(ahead), *self._to_device(*ahead))
            # [(hi - lo) * row_bytes] uint8 -> [hi - lo, ...]
            return self._off.rows_ready(buf, event).view(self.dtype).view(hi - lo, *self.shape[1:])
        self._count(hi - lo)
        if self._host is not None:
            return self._host[lo:hi].to(self.device, copy=True)
        rows = torch.empty((hi - lo, *self.shape[1:]), dtype=self.dtype)
        self._pread(lo, hi, rows.view(-1).view(torch.uint8))
        return rows.to(self.device)

    def _count(self, rows: int) -> None:
        if self._stats is not None:
            self._stats.residual_grad_bytes += rows * self.row_bytes

    def _pread(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Rows ``[lo, hi)`` of the file into ``out`` (host ``[(hi - lo) * row_bytes]`` uint8)."""
        pending = []
        for w in self._writes:  # these rows' writes first (a failed one raises here)
            if w[0] < hi and lo < w[1]:
                w[2].result()
            elif not w[2].done():
                pending.append(w)
        self._writes = pending
        view = memoryview(out.numpy())
        try:
            got = os.preadv(self._fd, [view], lo * self.row_bytes)
        except OSError as exc:
            raise disk_error(f"reading rows {lo}:{hi} of the residual gradient from", self.path, exc) from exc
        if got != len(view):
            raise disk_error(f"reading rows {lo}:{hi} of the residual gradient from", self.path,
                             OSError(5, f"read {got} of {len(view)} bytes"))

    def _to_device(self, lo: int, hi: int) -> tuple[torch.Tensor, Any]:
        self._off.stats.residual_grad_bytes += (hi - lo) * self.row_bytes
        if self._host is not None:  # last written on the same side stream: no event to wait for
            return self._off.rows_to_device(self._host[lo:hi].reshape(-1).view(torch.uint8), self.device)
        # staged through pinned memory (torch's cached host blocks: one is not reused before its copy has run)
        staging = torch.empty((hi - lo) * self.row_bytes, dtype=torch.uint8, pin_memory=self._off.pool.pin)
        self._pread(lo, hi, staging)
        return self._off.rows_to_device(staging, self.device)

    def write(self, lo: int, hi: int, rows: torch.Tensor) -> None:
        """Rows ``[lo, hi)`` set to ``rows``."""
        if self._dense is not None:
            self._dense[lo:hi] = rows
            return
        if self._ahead is not None and self._ahead[0][0] < hi and lo < self._ahead[0][1]:
            self._ahead = None  # fetched before this write: stale
        if self._off is not None and self._host is not None:
            src = rows.detach().to(self.dtype).contiguous().view(-1).view(torch.uint8)  # [(hi - lo) * row_bytes]
            self._off.copy_to_host(self._host[lo:hi].view(-1).view(torch.uint8), src)
            self._off.stats.residual_grad_bytes += src.numel()
            return
        if self._host is not None:
            self._host[lo:hi].copy_(rows)
            self._count(hi - lo)
            return
        if self._off is not None and self._off.disk_dir is not None:  # the offloader's I/O worker writes
            src = rows.detach().to(self.dtype).contiguous().view(-1).view(torch.uint8)  # [(hi - lo) * row_bytes]
            staging = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=self._off.pool.pin)
            copied = self._off.copy_to_host(staging, src)
            self._writes.append((lo, hi, self._off.submit_io(self._write_staged, copied, lo, hi, staging)))
            self._off.stats.residual_grad_bytes += src.numel()
            return
        self._pwrite(lo, hi, rows.detach().to("cpu", self.dtype).contiguous().view(-1).view(torch.uint8))
        self._count(hi - lo)

    def _write_staged(self, copied: Any, lo: int, hi: int, staging: torch.Tensor) -> None:
        """On the I/O worker: once the copy to ``staging`` has landed, its rows into the file."""
        self._off.ops.sync_event(copied)
        self._pwrite(lo, hi, staging)

    def _pwrite(self, lo: int, hi: int, data: torch.Tensor) -> None:
        """Host ``[(hi - lo) * row_bytes]`` uint8 into rows ``[lo, hi)`` of the file."""
        view, offset = memoryview(data.numpy()), lo * self.row_bytes
        try:
            while len(view):
                done = os.pwrite(self._fd, view, offset)
                view, offset = view[done:], offset + done
        except OSError as exc:
            raise disk_error(f"writing rows {lo}:{hi} of the residual gradient to", self.path, exc) from exc


class Target:
    """Where streams go (the offload target of ``--longctx-offload-target``); ``offloader``: the
    activation offloader whose host pool and side stream host streams use."""

    def __init__(self, disk_dir: Optional[str] = None, offloader: Any = None) -> None:
        self.disk_dir = disk_dir  # None: pinned host memory
        self.offloader = offloader

    def new(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> ResidualGradOffload:
        return ResidualGradOffload(shape, dtype, device, self.disk_dir, self.offloader)


def reads_streams(function: type) -> type:
    """Mark an autograd Function whose backward takes its output gradients' streams (:func:`take`)."""
    setattr(function, _READS_STREAMS, True)
    return function


def consumer_of(x: torch.Tensor, watch: grad_buffers.Watch) -> Optional[tuple]:
    """``(node, output slot)`` that will receive ``x``'s gradient, when it reads streams and nothing else
    sees that gradient; else ``None``.  Taken at forward."""
    node = x.grad_fn
    if node is None or not watch.private():
        return None
    function = getattr(type(node), "_forward_cls", None)
    if not getattr(function, _READS_STREAMS, False):
        return None
    return node, x.output_nr


def hand_over(consumer: tuple, stream: ResidualGradOffload) -> torch.Tensor:
    """Give ``stream`` (the gradient of the consumer's output slot) to the consumer node; returns the
    zero gradient autograd passes instead."""
    node, slot = consumer
    streams = getattr(node, _STREAMS, None)
    if streams is None:
        streams = {}
        setattr(node, _STREAMS, streams)
    streams[slot] = stream
    zero = torch.zeros((), dtype=stream.dtype, device=stream.device).expand(stream.shape)
    setattr(zero, _ZERO, True)
    return zero


def take(ctx: Any, slot: int, grad: Optional[torch.Tensor]) -> tuple[Optional[ResidualGradOffload], Optional[torch.Tensor]]:
    """In a consumer's backward: output slot ``slot``'s stream (or ``None``) and what autograd passed that
    must be added to it (``None`` when that is the zero the producer returned)."""
    streams = getattr(ctx, _STREAMS, None)
    stream = streams.pop(slot, None) if streams else None
    if grad is not None and getattr(grad, _ZERO, False):
        if stream is None:
            raise RuntimeError(f"{FLAG}: a streamed residual gradient reached its consumer without its stream "
                               "(the gradient was produced by another backward than this one)")
        return stream, None
    return stream, grad
