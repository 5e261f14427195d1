"""Every rank of a context-parallel group must pass the same configuration: checked once, loudly.

Ranks that disagree on the algorithm, the mask or the shapes would otherwise hang in mismatched
transfers, abort inside the communication library, or return silently inconsistent outputs.  The
first call of a configuration all-gathers one small int64 vector describing it (one collective, a
few hundred bytes) and compares it field by field; a mismatch raises the same ``ValueError`` on
every rank, naming the parameter and which ranks hold which value.  Agreed configurations are
cached per group, so later calls cost no collective at all.

The packing (``cu_seqlens`` and ``cu_seqlens_padded``) travels as its document count, its padded
total and a 256-bit BLAKE2 digest of the exact offsets: two different packings never compare equal
short of a cryptographic collision (a weighted sum would let ``(0, 4, 28, 32)`` and ``(0, 16, 20,
32)`` pass).
"""

from __future__ import annotations

import hashlib
import struct

import torch
import torch.distributed as dist

from .args import ALGORITHMS, AttentionArgs
from .layout import Packing

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_AGREED: set = set()  # (group, configuration) pairs every rank of the group has agreed on
_MAX_CACHED = 4096


def _dtype_code(dtype: torch.dtype) -> int:
    if dtype in _DTYPES:
        return _DTYPES.index(dtype)
    return int.from_bytes(hashlib.blake2b(str(dtype).encode(), digest_size=7).digest(), "little")


def _packing_digest(packing: Packing) -> list[int]:
    data = struct.pack(f"<{2 * len(packing.cu_seqlens)}q", *packing.cu_seqlens, *packing.cu_seqlens_padded)
    digest = hashlib.blake2b(data, digest_size=32).digest()
    return [int.from_bytes(digest[i:i + 8], "little", signed=True) for i in range(0, 32, 8)]


def _configuration(algorithm: str, args: AttentionArgs, q, k, v, packing: Packing, ulysses_size, hcp: bool,
                   sink: bool = False) -> list[tuple[str, object, list[int]]]:
    """(parameter, readable value, int64 encoding) of everything the ranks must agree on."""
    scale_bits = struct.unpack("<q", struct.pack("<d", args.softmax_scale))[0]
    return [
        ("algorithm", algorithm, [ALGORITHMS.index(algorithm)]),
        ("causal", args.mask.causal, [int(args.mask.causal)]),
        ("window_size", args.mask.window, list(args.mask.window)),
        ("softmax_scale", args.softmax_scale, [scale_bits]),
        ("dtype", q.dtype, [_dtype_code(q.dtype)]),
        ("query heads (q.shape[-2])", q.shape[2], [q.shape[2]]),
        ("k/v heads (k.shape[-2])", k.shape[2], [k.shape[2]]),
        ("head dim d_qk (q.shape[-1])", q.shape[3], [q.shape[3]]),
        ("head dim d_v (v.shape[-1])", v.shape[3], [v.shape[3]]),
        ("batch size", q.shape[0], [q.shape[0]]),
        ("local length (tokens on this rank)", q.shape[1], [q.shape[1]]),
        ("ulysses_size", ulysses_size, [-1 if ulysses_size is None else int(ulysses_size)]),
        ("hcp_groups", "given" if hcp else None, [int(hcp)]),
        ("softmax_offset (attention sinks)", "given" if sink else None, [int(sink)]),
        ("packing (cu_seqlens, cu_seqlens_padded)", _describe(packing),
         [packing.num_docs, packing.padded_total, *_packing_digest(packing)]),
    ]


def _describe(packing: Packing) -> str:
    def short(offsets):
        return str(offsets) if len(offsets) <= 12 else f"({', '.join(map(str, offsets[:10]))}, ... {offsets[-1]})"
    return f"cu_seqlens={short(packing.cu_seqlens)}, cu_seqlens_padded={short(packing.cu_seqlens_padded)}"


def _device(group: dist.ProcessGroup, like: torch.Tensor) -> torch.device:
    """Where the collective runs: the tensors' CUDA device under NCCL, else the host."""
    backend = str(dist.get_backend(group))
    return like.device if like.device.type == "cuda" and "nccl" in backend else torch.device("cpu")


def check_ranks_agree(group: dist.ProcessGroup, *, algorithm: str, args: AttentionArgs, q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, packing: Packing, ulysses_size, hcp: bool,
                      sink: bool = False) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all pass the same configuration.

    q/k/v ``[b, t, h, d]`` (the kernels' layout).  One ``all_gather`` of a ``[P, n]`` int64 table on
    the first call of a configuration; none afterwards.  Every rank must make the first call.
    """
    fields = _configuration(algorithm, args, q, k, v, packing, ulysses_size, hcp, sink)
    codes = [x for _, _, code in fields for x in code]
    key = (group, tuple(codes))
    if key in _AGREED:
        return
    mine = torch.tensor(codes, dtype=torch.int64, device=_device(group, q))
    table = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(table, mine, group=group)  # P x [n]: every rank's configuration
    rows = [row.tolist() for row in table]
    names, problems, start = [], [], 0
    for name, value, code in fields:
        end = start + len(code)
        held: dict[tuple, list[int]] = {}
        for rank, row in enumerate(rows):
            held.setdefault(tuple(row[start:end]), []).append(rank)
        if len(held) > 1:
            split = " vs ".join(f"cp ranks {ranks}" for ranks in held.values())
            names.append(name)
            problems.append(f"{name}: values differ across the ranks of cp_group ({split}; this rank, "
                            f"{dist.get_rank(group)}, has {value})")
        start = end
    if problems:
        raise ValueError(f"the ranks of cp_group disagree on the {', '.join(names)}. " + "; ".join(problems)
                         + ". Every rank of cp_group must call cp_attention with the same algorithm, mask, dtype, "
                         "head counts and dims, local length and packing")
    if len(_AGREED) >= _MAX_CACHED:
        _AGREED.clear()
    _AGREED.add(key)
