"""The layout of a streamed unit: its parameters' byte offsets in one weight buffer and one gradient buffer."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

ALIGN = 64  # bytes: every parameter's view starts on this boundary


@dataclasses.dataclass
class Param:
    param: torch.nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    offset: int  # byte offset in the unit's weight bytes
    goffset: int  # byte offset in the unit's gradient bytes (-1: no gradient)
    grad_dtype: torch.dtype
    moffset: int = -1  # byte offset in the unit's float32 master bytes (-1: the weight is float32 itself)


class Unit:
    """One unit's parameters, their layout and where their bytes live between uses."""

    def __init__(self, index: int, module: Any, grad_dtype: Optional[torch.dtype]) -> None:
        # a module, or a tuple of modules sharing parameters (tied embedding and output layer): every one of
        # them brings the unit's weights in for its forward
        self.modules = tuple(module) if isinstance(module, (tuple, list)) else (module,)
        self.index, self.module = index, self.modules[0]
        self.params: list[Param] = []
        nbytes = gbytes = mbytes = 0
        seen: set = set()
        for p in (q for m in self.modules for q in m.parameters()):
            if id(p) in seen:
                continue
            seen.add(id(p))
            gdt = grad_dtype or p.dtype
            goff = -1
            if p.requires_grad:
                goff, gbytes = gbytes, aligned(gbytes + p.numel() * torch.empty((), dtype=gdt).element_size())
            moff = -1
            if p.dtype in (torch.bfloat16, torch.float16):
                moff, mbytes = mbytes, aligned(mbytes + p.numel() * 4)
            self.params.append(Param(p, p.shape, p.dtype, nbytes, goff, gdt, moff))
            nbytes = aligned(nbytes + p.numel() * p.element_size())
        self.nbytes, self.gbytes = nbytes, gbytes
        self.mbytes = mbytes  # float32 master copies of its low-precision weights (disk, under bf16)
        self.host: Optional[torch.Tensor] = None  # [nbytes] uint8 (host target)
        self.ghost: Optional[torch.Tensor] = None  # [gbytes] uint8 gradient accumulator (host target)
        self.path: Optional[str] = None  # weights file (disk target)
        self.gpath: Optional[str] = None  # gradient accumulator file (disk target)
        self.mpath: Optional[str] = None  # float32 master weights file (disk target, low-precision weights)
        self.has_grad = False  # the accumulator holds gradients of this step
        self.reduced = False  # ... summed over the reduction group (a micro-batch with sync_grads ended)
        self.wslot: Optional[int] = None
        self.gslot: Optional[int] = None
        self.pending: set = set()  # ids of parameters whose gradient has not come yet
        self.in_forward = 0
        self.prefetched = False  # in a weight slot ahead of a use; a load that finds no free slot takes it
        self.ready: Any = None  # GPU: event of the copy into its weight slot, for the compute stream to wait on
        self.copied_out: Any = None  # GPU: event of its last gradient copy to the host accumulator


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    n = shape.numel() * torch.empty((), dtype=dtype).element_size()
    return buf[offset:offset + n].view(dtype).view(shape)


def pack(u: Unit, dst: torch.Tensor) -> torch.Tensor:
    """``u``'s parameters' current values laid out in ``dst`` (``[>= u.nbytes]`` uint8) at their offsets."""
    for p in u.params:
        src = p.param.data.reshape(-1).view(torch.uint8)  # [numel * itemsize] bytes
        dst[p.offset:p.offset + src.numel()].copy_(src)
    return dst


def tensors(out: Any) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in tensors(o)]
    return []


def add_bytes(u: Unit, acc: torch.Tensor, add: torch.Tensor, non_blocking: bool = False) -> None:
    """``u``'s gradients in ``add`` added into those in ``acc`` (both its gradient bytes), parameter by
    parameter, each brought to ``acc``'s device on its way."""
    for p in u.params:
        if p.goffset >= 0:
            view(acc, p.goffset, p.grad_dtype, p.shape).add_(
                view(add, p.goffset, p.grad_dtype, p.shape).to(acc.device, non_blocking=non_blocking))
