"""Attention for a layer that runs one sequence tile at a time.

A layer replayed in tiles (:mod:`megatron_longctx.memory.tiled_recompute`) runs its token-wise parts
(norms, projections, MLP) on one tile of this rank's tokens at a time, but each query tile still
sees every key before it.  :class:`TiledKV` holds those keys for one layer:

1. :meth:`TiledKV.store` collects this rank's K/V tile by tile;
2. :meth:`TiledKV.gather` gathers them over the CP group once (the all-gather of Llama 3, Dubey et
   al. 2024, §3.3.2; with one rank: the local K/V).  With one sequence per micro-batch the tiles are
   stored straight into this rank's row of the gathered buffers, which the all-gather fills in place
   and the attention reads in rank order (no send buffer, no reordering copy); the dK/dV sums are
   then the reduce-scatter's send buffers as they are.  Otherwise the K/V are reordered to natural
   order;
3. :meth:`TiledKV.attend` is the attention of one query tile (an autograd function whose backward
   adds the tile's dK/dV into accumulators over the gathered sequence);
4. :meth:`TiledKV.reduce_grads` reduce-scatters dK/dV back to their owners, and
   :meth:`TiledKV.kv_grads` hands each local tile its share.

A rank then holds the gathered K/V (and in backward their float32 gradients) plus one tile's
activations, not a whole layer's.  Tensors come in Megatron's ``[s, b, h, d]``; ``[b, s, h, d]`` inside.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .allgather import gather_kv, scatter_kv_grads
from .args import AttentionArgs
from .block_loop import GradSum, Rows, attend_first, attend_segments_backward
from .comm import all_gather_in_place, reduce_scatter
from .layout import SeqLayout, pooled_index
from .schedule import allgather_calls, allgather_calls_by_rank
from .segments import restrict_rows, split_keys

# Keys per kernel call of a query tile: its backward's dK/dV temporaries hold at most this many keys.
KEY_BLOCK = 2048


class TiledKV:
    """The whole sequence's K/V (and dK/dV) of one layer, for attention one query tile at a time.

    ``group``: the CP group (``None`` or one rank: no communication); ``local_len``: this rank's
    tokens (its shard of Megatron's load-balanced layout).
    """

    def __init__(self, group: Optional[dist.ProcessGroup], local_len: int, args: AttentionArgs) -> None:
        self.cp = 1 if group is None else dist.get_world_size(group)
        self.group = group if self.cp > 1 else None
        self.rank = dist.get_rank(group) if self.group is not None else 0
        self.layout = SeqLayout.dense(local_len * self.cp, self.cp)
        self.args = args
        self.calls = allgather_calls(self.layout, self.rank, args.mask)  # keys in natural order
        self.by_rank = False  # the gathered K/V (and dK/dV) in rank order, filled in place
        self._k = self._v = None  # local K/V [b, t, h_kv, d], filled tile by tile
        self._bufs: Optional[list] = None  # by rank: the gathered K and V buffers [P, t, h_kv, d]
        self.k_all = self.v_all = None  # gathered K/V [b, P*t, h_kv, d]
        self.dkv_all: Optional[GradSum] = None  # their gradients (accumulator dtype)
        self._dk = self._dv = None  # this rank's dK/dV after the reduce-scatter [b, t, h_kv, d]

    def store(self, lo: int, hi: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep tile ``[lo, hi)`` of this rank's k ``[t, b, h_kv, d_qk]`` and v ``[t, b, h_kv, d_v]``."""
        if self._k is None:
            t = self.layout.local_len
            if self.group is not None and k.shape[1] == 1:  # one sequence: this rank's row of the gathered buffers
                self.by_rank = True
                self.calls = allgather_calls_by_rank(self.layout, self.rank, self.args.mask)
                self._bufs = [x.new_empty(self.cp, t, *x.shape[2:]) for x in (k, v)]  # [P, t, h_kv, d]
                self._k, self._v = (buf[self.rank].unsqueeze(0) for buf in self._bufs)  # [1, t, h_kv, d]
            else:
                self._k = k.new_empty(k.shape[1], t, *k.shape[2:])
                self._v = v.new_empty(v.shape[1], t, *v.shape[2:])
        self._k[:, lo:hi] = k.transpose(0, 1)
        self._v[:, lo:hi] = v.transpose(0, 1)

    def gather(self, with_grads: bool) -> None:
        """The gathered K/V from the stored tiles (and empty dK/dV sums when ``with_grads``)."""
        if self._k is None:
            raise RuntimeError("TiledKV.gather before any tile was stored")
        if self.group is None:
            self.k_all, self.v_all = self._k, self._v
        elif self.by_rank:
            bufs, self._bufs = self._bufs, None
            for buf in bufs:
                all_gather_in_place(buf.view(self.cp, -1), self.group)
            self.k_all, self.v_all = (buf.view(1, -1, *buf.shape[2:]) for buf in bufs)  # [1, P*t, h_kv, d]
        else:
            index = pooled_index(self.layout, self.cp, self._k.device)
            self.k_all, self.v_all = gather_kv(self._k, self._v, self.group, index)
        self._k = self._v = None
        if with_grads:
            acc = torch.promote_types(self.k_all.dtype, torch.float32)
            self.dkv_all = GradSum([self.k_all.shape, self.v_all.shape], acc, self.k_all.device)

    def attend(self, q: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Attention of query tile ``[lo, hi)``, q ``[t', b, h_q, d_qk]`` -> ``[t', b, h_q, d_v]``."""
        return _AttendTile.apply(q, self, lo, hi)

    def reduce_grads(self) -> None:
        """Sum every rank's dK/dV contributions into the owner's share; drop the gathered tensors.

        The gathered K/V are dropped first (:func:`.allgather.scatter_kv_grads` then frees each gradient as
        it moves into the send buffer)."""
        self.k_all = self.v_all = None
        dkv, self.dkv_all = self.dkv_all, None
        grads = dkv.result()  # [dk_all, dv_all]
        del dkv
        if self.group is None:
            self._dk, self._dv = grads
            return
        shapes = [(g.shape[0], self.layout.local_len, *g.shape[2:]) for g in grads]
        if self.by_rank:  # [1, P*t, h_kv, d] in rank order: row j of [P, t*h_kv*d] is rank j's share
            out = []
            for shape in shapes:
                out.append(reduce_scatter(grads.pop(0).view(self.cp, -1), self.group).view(shape))
            self._dk, self._dv = out
            return
        index = pooled_index(self.layout, self.cp, grads[0].device)
        self._dk, self._dv = scatter_kv_grads(grads, self.group, index, shapes)

    def kv_grads(self, lo: int, hi: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """dK/dV of local tile ``[lo, hi)`` as ``[t', b, h_kv, d]`` in ``dtype``."""
        return (self._dk[:, lo:hi].transpose(0, 1).to(dtype), self._dv[:, lo:hi].transpose(0, 1).to(dtype))

    def release(self) -> None:
        self._k = self._v = self.k_all = self.v_all = self.dkv_all = self._dk = self._dv = self._bufs = None


class _AttendTile(torch.autograd.Function):
    """One query tile against the gathered K/V; backward adds into the gathered dK/dV."""

    @staticmethod
    def forward(ctx, q, kv: TiledKV, lo: int, hi: int):
        calls = split_keys(restrict_rows(kv.calls, lo, hi), KEY_BLOCK)
        qb = q.transpose(0, 1).contiguous()  # [b, t', h_q, d_qk] (a view when b = 1)
        out, lse = attend_first(qb, kv.k_all, kv.v_all, calls, kv.args.softmax_scale, kv.args.backend)
        out = out.to(q.dtype)  # [b, t', h_q, d_v]
        ctx.save_for_backward(qb, out, lse)
        ctx.kv, ctx.calls = kv, calls
        return out.transpose(0, 1)  # [t', b, h_q, d_v]

    @staticmethod
    def backward(ctx, dout):
        qb, out, lse = ctx.saved_tensors
        kv = ctx.kv
        if kv.dkv_all is None:
            raise RuntimeError("a tiled attention backward ran without dK/dV accumulators (TiledKV.gather(True))")
        dq = GradSum([qb.shape], lse.dtype, qb.device)  # [b, t', h_q, d_qk]
        rows = Rows(qb, out, lse, dout.transpose(0, 1).contiguous())  # dout [b, t', h_q, d_v]
        attend_segments_backward(rows, kv.k_all, kv.v_all, ctx.calls, kv.args.softmax_scale, kv.args.backend, dq,
                                 kv.dkv_all)
        return dq.result()[0].to(qb.dtype).transpose(0, 1), None, None, None
