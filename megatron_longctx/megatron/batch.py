"""Split a global batch over the context-parallel ranks with Megatron's own ``get_batch_on_this_cp_rank``.

Megatron cuts the sequence into ``2·cp`` chunks and rank ``r`` keeps chunks ``r`` and ``2·cp−1−r``
(the zigzag layout RoPE and :mod:`megatron_longctx.attention` expect).  Its signature differs by
version: 0.16 ``(batch, cp_group=None)`` falls back to ``parallel_state``; 0.19
``(batch, is_hybrid_cp, cp_group=None, ...)`` falls back to the WORLD group when ``cp_group`` is
``None``, which splits over every rank even with CP=1.  :func:`get_batch_on_this_cp_rank` always
passes the CP group explicitly and checks the sequence length first.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.distributed as dist


def _megatron_fn():
    from megatron.core import utils

    return utils.get_batch_on_this_cp_rank


def get_batch_on_this_cp_rank(batch: dict[str, Any], cp_group: Optional[dist.ProcessGroup] = None) -> dict[str, Any]:
    """This CP rank's zigzag share of ``batch`` (tensors ``[b, s, ...]``; ``attention_mask`` ``[b, 1, s, s]``).

    ``cp_group``: the context-parallel group (default: ``parallel_state.get_context_parallel_group()``).
    Raises ``ValueError`` naming ``--seq-length`` when ``s`` is not a multiple of ``2·cp``.
    """
    if cp_group is None:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    cp_size = dist.get_world_size(cp_group)
    if cp_size > 1 and batch.get("cu_seqlens") is not None:
        # Packed (THD): per-document zigzag.  Megatron 0.19 would call Transformer Engine's
        # thd_get_partitioned_indices here, and 0.16 would split the packed sequence as one document.
        from megatron_longctx.attention import Packing, packed_batch_on_this_cp_rank

        packing = Packing.from_cu_seqlens(batch["cu_seqlens"], batch.get("cu_seqlens_padded"))
        local, _ = packed_batch_on_this_cp_rank(batch, packing, dist.get_rank(cp_group), cp_size)
        return local
    if cp_size > 1:
        for key, value in batch.items():
            if not isinstance(value, torch.Tensor) or key in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"):
                continue
            seq_dim = 2 if key == "attention_mask" else 1
            if value.dim() > seq_dim and value.shape[seq_dim] % (2 * cp_size) != 0:
                raise ValueError(
                    f"batch[{key!r}] has sequence length {value.shape[seq_dim]}, not a multiple of 2 x "
                    f"--context-parallel-size ({2 * cp_size}): choose --seq-length divisible by {2 * cp_size}")
    fn = _megatron_fn()
    if "is_hybrid_cp" in inspect.signature(fn).parameters:  # Megatron-Core >= 0.17
        return fn(dict(batch), False, cp_group=cp_group)
    return fn(dict(batch), cp_group=cp_group)
