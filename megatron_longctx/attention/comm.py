"""Communication of the context-parallel algorithms: a P2P ring exchanger, collectives, a byte counter.

:class:`RingComm` follows ring-flash-attention's ``send_recv`` -> ``commit`` -> ``wait`` shape, so
the overlap of a transfer with the compute of the current block is visible in each algorithm's
loop.  On CUDA the transfers are issued on a dedicated communication stream (one per device): the
stream first waits for the compute stream (the send buffer is ready), the buffers are marked as used
by it (``record_stream``, so the caching allocator does not recycle them early) and ``wait`` makes
the compute stream wait for the transfer.  On CPU (gloo) the same code path runs with asynchronous
``isend``/``irecv``.  Messages are flat contiguous buffers (:func:`pack`) so one step is one
message each way whatever the number of tensors; every exchange posts its send and its receive
together through ``batch_isend_irecv``, so two ranks whose previous and next peer coincide cannot
deadlock.

Every byte a rank sends is added to :data:`STATS` (per collective kind): P2P counts the message,
collectives count what a bandwidth-optimal ring implementation sends from one rank,
``(P-1)/P`` of the gathered / scattered / exchanged buffer.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Sequence

import torch
import torch.distributed as dist


@dataclasses.dataclass
class CommStats:
    """Bytes sent and operations issued by this process, per kind (``p2p``, ``all_to_all``, ...)."""

    bytes_sent: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes_sent[kind] += int(nbytes)
        self.ops[kind] += 1

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.ops.clear()

    def total_bytes(self) -> int:
        return sum(self.bytes_sent.values())


STATS = CommStats()

_COMM_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def comm_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The communication stream of a CUDA device (created once); None on CPU."""
    if device.type != "cuda":
        return None
    if device not in _COMM_STREAMS:
        _COMM_STREAMS[device] = torch.cuda.Stream(device=device)
    return _COMM_STREAMS[device]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pack(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Concatenate flattened tensors into one contiguous message ``[sum numel]``."""
    dtype = dtype or tensors[0].dtype
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    offset = 0
    for t in tensors:
        flat[offset:offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()
    return flat


def unpack(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Views into a message made by :func:`pack` (no copy)."""
    views, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        views.append(flat[offset:offset + n].view(shape))
        offset += n
    return views


class RingComm:
    """One buffer per step exchanged in ``group``: sent to ``rank+hop``, received from ``rank-hop``.

    ``tag`` separates two exchangers that run at the same time between the same ranks (K/V and
    dK/dV in the ring backward).  At most one exchange is in flight per exchanger.
    """

    def __init__(self, group: dist.ProcessGroup, tag: int = 0) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.tag = tag
        self._ops: list[dist.P2POp] = []
        self._buffers: list[torch.Tensor] = []
        self._requests: list | None = None
        self._stream: torch.cuda.Stream | None = None

    def send_recv(self, send: torch.Tensor, hop: int) -> torch.Tensor:
        """Queue ``send`` (contiguous) for ``rank+hop`` and a same-shaped receive from ``rank-hop``."""
        dst, src = (self.rank + hop) % self.size, (self.rank - hop) % self.size
        recv = torch.empty_like(send)
        self._ops += [
            dist.P2POp(dist.isend, send, dist.get_global_rank(self.group, dst), self.group, self.tag),
            dist.P2POp(dist.irecv, recv, dist.get_global_rank(self.group, src), self.group, self.tag),
        ]
        self._buffers += [send, recv]
        STATS.add("p2p", _nbytes(send))
        return recv

    def commit(self) -> None:
        """Start the queued transfers."""
        self._stream = comm_stream(self._buffers[0].device)
        if self._stream is None:
            self._requests = dist.batch_isend_irecv(self._ops)
        else:
            self._stream.wait_stream(torch.cuda.current_stream())  # send buffers are written
            with torch.cuda.stream(self._stream):
                self._requests = dist.batch_isend_irecv(self._ops)
            for t in self._buffers:
                t.record_stream(self._stream)
        self._ops = []

    def wait(self) -> None:
        """Block until the transfers are done; the received buffers are then safe to read."""
        for request in self._requests or ():
            request.wait()
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        self._requests, self._buffers = None, []


def all_to_all(send: torch.Tensor, group: dist.ProcessGroup, out: torch.Tensor | None = None) -> torch.Tensor:
    """``send[j]`` goes to rank ``j``; returns ``recv`` with ``recv[i]`` from rank ``i``.

    ``send`` ``[P, n]`` contiguous -> ``[P, n]`` (written into ``out`` when given: contiguous, same shape).
    """
    recv = torch.empty_like(send) if out is None else out
    dist.all_to_all_single(recv, send, group=group)  # [P, n] -> [P, n]
    STATS.add("all_to_all", _nbytes(send) * (send.shape[0] - 1) // send.shape[0])
    return recv


def all_to_all_rows(send_rows: Sequence[torch.Tensor], recv_rows: Sequence[torch.Tensor],
                    group: dist.ProcessGroup) -> None:
    """An all-to-all whose rows are separate tensors: ``send_rows[j]`` goes to rank ``j``, the row from
    rank ``i`` is written into ``recv_rows[i]``.

    Each row is a contiguous tensor of ``n`` elements (views of any buffer, in any order: this is what
    lets a receive land straight in its final place), sent by point-to-point messages posted together
    (``batch_isend_irecv``, as :class:`RingComm`); a rank's own row is copied.  Counted as one
    ``all_to_all`` of ``P`` rows.
    """
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ops = []
    for j in range(size):
        if j != rank:
            peer = dist.get_global_rank(group, j)
            ops += [dist.P2POp(dist.isend, send_rows[j], peer, group, _ROWS_TAG),
                    dist.P2POp(dist.irecv, recv_rows[j], peer, group, _ROWS_TAG)]
    requests = dist.batch_isend_irecv(ops) if ops else []
    recv_rows[rank].copy_(send_rows[rank])
    for request in requests:
        request.wait()
    STATS.add("all_to_all", sum(_nbytes(t) for j, t in enumerate(send_rows) if j != rank))


_ROWS_TAG = 2  # apart from the ring's K/V (0) and dK/dV (1) messages

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` ``[n]`` (contiguous, same on every rank) -> ``[P, n]``, row ``i`` from rank ``i``."""
    size = dist.get_world_size(group)
    out = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)  # [n] -> [P*n]
    STATS.add("all_gather", _nbytes(x) * (size - 1))
    return out.view(size, *x.shape)  # [P, n]


def all_gather_in_place(buf: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``buf`` ``[P, n]`` (contiguous) whose row ``rank`` holds this rank's part: every row filled, in place
    (no send buffer: the collective's input is the output's own row, as NCCL's in-place all-gather)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if buf.shape[0] != size or not buf.is_contiguous():
        raise ValueError(f"all_gather_in_place: need a contiguous [{size}, n] buffer, got {tuple(buf.shape)}")
    _all_gather_single(buf.view(-1), buf[rank], group=group)
    STATS.add("all_gather", _nbytes(buf[rank]) * (size - 1))
    return buf


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` ``[P, n]`` -> ``[n]``: the sum over ranks of row ``rank``."""
    size = dist.get_world_size(group)
    out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x.reshape(-1), group=group)  # [P*n] -> [n]
    STATS.add("reduce_scatter", _nbytes(out) * (size - 1))
    return out
