"""Block attention through the flash-attn package: FlashAttention-3 on Hopper, FlashAttention-2 elsewhere.

FlashAttention-2 (Dao 2023; package ``flash_attn`` >= 2.5) and FlashAttention-3 (Shah et al. 2024;
module ``flash_attn_interface``, built from flash-attn's ``hopper/``) both take our
``[b, s, h, d]`` layout, GQA/MQA natively, ``softmax_scale``, ``causal`` and bottom-right aligned
``window_size`` (flash-attn >= 2.1), and return ``lse`` ``[b, h_q, s_q]`` in float32.  Blocks reach
them as the pieces of :func:`.driver.flash2_pieces` (exact under flash-attn 2's window rewrites),
head dims padded to a multiple of 8.

Forward goes through the public ``flash_attn_func(..., return_attn_probs=True)`` (stable across
releases).  Backward needs the private ``_flash_attn_backward``, whose arguments changed: flash-attn
2.5/2.6 take ``window_size=(left, right)`` (2.6 adds ``softcap``), 2.7+ ``window_size_left``/
``window_size_right``; the version number picks the call.  FlashAttention-3 has no usable version
number, so its backward is used only when it has the keyword arguments of its July-2025 interface
(checked once; otherwise FlashAttention-2 serves).

Import-guarded: without the package ``check`` says "flash-attn is not installed".  Written to the
contract of :mod:`.base` without a GPU at hand; the piece and window arithmetic it shares with
:mod:`.sdpa_cuda` is tested on CPU.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types

import torch
from packaging.version import Version

from . import driver
from .base import BlockArgs, LiveBlock

name = "flash_attn"

_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
_FA2_MIN = Version("2.5")
_FA3_BACKWARD_KEYWORDS = {"dq", "dk", "dv", "softmax_scale", "is_causal", "window_size_left", "window_size_right"}


def _missing(err: ImportError, package: str) -> bool:
    """The package itself is absent (not one of its compiled parts failing to load)."""
    return isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] == package


@functools.lru_cache(maxsize=None)
def _fa2() -> types.SimpleNamespace | str:
    """flash-attn 2's entry points, or the reason they cannot be used."""
    try:
        fa = importlib.import_module("flash_attn")
        interface = importlib.import_module("flash_attn.flash_attn_interface")
    except ImportError as err:
        if _missing(err, "flash_attn"):
            return "flash-attn is not installed"
        return f"flash-attn failed to import: {err}"
    except (OSError, RuntimeError) as err:  # a build that does not match this torch/CUDA
        return f"flash-attn failed to import: {err}"
    version = Version(getattr(fa, "__version__", "0"))
    if version < _FA2_MIN:
        return f"flash-attn {version} is too old; {_FA2_MIN} or newer is needed"
    return types.SimpleNamespace(version=version, func=fa.flash_attn_func, backward=interface._flash_attn_backward)


@functools.lru_cache(maxsize=None)
def _fa3() -> types.ModuleType | str:
    """FlashAttention-3's interface module, or the reason it cannot be used."""
    try:
        fa3 = importlib.import_module("flash_attn_interface")
    except ImportError as err:
        if _missing(err, "flash_attn_interface"):
            return "flash-attn 3 (flash_attn_interface) is not installed"
        return f"flash-attn 3 failed to import: {err}"
    except (OSError, RuntimeError) as err:
        return f"flash-attn 3 failed to import: {err}"
    bwd = getattr(fa3, "_flash_attn_backward", None)
    if bwd is None or not hasattr(fa3, "flash_attn_func"):
        return "flash_attn_interface has no flash_attn_func/_flash_attn_backward"
    # torch.library custom ops keep the decorated function as _init_fn.
    params = set(inspect.signature(getattr(bwd, "_init_fn", bwd)).parameters)
    missing = _FA3_BACKWARD_KEYWORDS - params
    if missing:
        return f"flash_attn_interface._flash_attn_backward lacks {sorted(missing)} (an older FlashAttention-3)"
    return fa3


def _fa2_backward_kwargs(version: Version, scale: float, causal: bool, left: int, right: int) -> dict:
    kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None, deterministic=False)
    if version >= Version("2.7"):
        kwargs.update(window_size_left=left, window_size_right=right, softcap=0.0)
    else:
        kwargs.update(window_size=(left, right))
        if version >= Version("2.6"):
            kwargs.update(softcap=0.0)
    return kwargs


class _FlashAttn2Pieces:
    """:class:`.driver.PieceKernel` over flash-attn 2."""

    head_multiple = 8

    def __init__(self, fa2: types.SimpleNamespace):
        self.fa2 = fa2

    def forward(self, q, k, v, scale: float, piece: LiveBlock):
        causal, left, right = piece.flash_window()
        out, lse, _ = self.fa2.func(
            q, k, v, dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(left, right),
            return_attn_probs=True,
        )
        return out, lse  # [b, s_q, h_q, D], [b, h_q, s_q] float32

    def backward(self, dout, q, k, v, out, lse, scale: float, piece: LiveBlock):
        causal, left, right = piece.flash_window()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kwargs = _fa2_backward_kwargs(self.fa2.version, scale, causal, left, right)
        self.fa2.backward(dout, q, k, v, out, lse, dq, dk, dv, **kwargs)  # fills dq, dk, dv
        return dq, dk, dv


class _FlashAttn3Pieces:
    """:class:`.driver.PieceKernel` over FlashAttention-3."""

    head_multiple = 8

    def __init__(self, fa3: types.ModuleType):
        self.fa3 = fa3

    def forward(self, q, k, v, scale: float, piece: LiveBlock):
        causal, left, right = piece.flash_window()
        out, lse = self.fa3.flash_attn_func(
            q, k, v, softmax_scale=scale, causal=causal, window_size=(left, right), return_attn_probs=True
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale: float, piece: LiveBlock):
        causal, left, right = piece.flash_window()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self.fa3._flash_attn_backward(
            dout, q, k, v, out, lse,
            cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None, sequed_k=None, max_seqlen_q=None, max_seqlen_k=None,
            dq=dq, dk=dk, dv=dv, softmax_scale=scale, is_causal=causal,
            window_size_left=left, window_size_right=right, softcap=0.0, deterministic=False,
        )  # fills dq, dk, dv
        return dq, dk, dv


def _kernel_for(device: torch.device) -> driver.PieceKernel | str:
    """FlashAttention-3 on sm90 when usable, else FlashAttention-2 on sm80+, else the reason."""
    major, minor = torch.cuda.get_device_capability(device)
    fa3 = _fa3()
    if major == 9 and not isinstance(fa3, str):
        return _FlashAttn3Pieces(fa3)
    fa2 = _fa2()
    if isinstance(fa2, str):
        return fa2
    if (major, minor) < (8, 0):
        return "flash-attn 2 needs an sm80 or newer GPU"
    return _FlashAttn2Pieces(fa2)


def available(device: torch.device) -> str | None:
    """``None`` when the backend can run on ``device`` at all, else the reason."""
    device = torch.device(device)
    fa2, fa3 = _fa2(), _fa3()
    if isinstance(fa2, str) and isinstance(fa3, str):
        return fa2 if fa2 == "flash-attn is not installed" else f"{fa2}; {fa3}"
    if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
        return f"flash_attn needs NVIDIA CUDA tensors, not {device}"
    kernel = _kernel_for(device)
    return kernel if isinstance(kernel, str) else None


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: BlockArgs) -> str | None:
    reason = available(q.device)
    if reason is not None:
        return reason
    if q.dtype not in _DTYPES:
        return f"flash_attn supports float16 and bfloat16, not {q.dtype}"
    d = driver.padded_head_dim(q.shape[-1], v.shape[-1], 8)
    if d > _MAX_HEAD_DIM:
        return f"flash_attn supports head dims up to {_MAX_HEAD_DIM}; this block needs {d}"
    return None


def _ensure(q, k, v, args) -> driver.PieceKernel:
    driver.require(check(q, k, v, args))
    return _kernel_for(q.device)


@torch.no_grad()
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: BlockArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Block forward (layouts in :mod:`.base`): out ``[b, s_q, h_q, d_v]``, lse ``[b, h_q, s_q]``."""
    kernel = _ensure(q, k, v, args)
    return driver.forward(kernel, driver.flash2_pieces(args, q.shape[1], k.shape[1]), q, k, v, args)


@torch.no_grad()
def backward(dout, q, k, v, out, lse, args: BlockArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block backward given the final ``out``/``lse`` of each row (FlashAttention-2 backward)."""
    kernel = _ensure(q, k, v, args)
    pieces = driver.flash2_pieces(args, q.shape[1], k.shape[1])
    return driver.backward(kernel, pieces, dout, q, k, v, out, lse, args)
