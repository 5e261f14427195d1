"""Block attention through the flash-attn package: FlashAttention-3 on Hopper, FlashAttention-2 elsewhere.

FlashAttention-2 (Dao 2023; package ``flash_attn`` >= 2.5) and FlashAttention-3 (Shah et al. 2024;
module ``flash_attn_interface``, built from flash-attn's ``hopper/``) both take our
``[b, s, h, d]`` layout, GQA/MQA natively, ``softmax_scale``, ``causal`` and bottom-right aligned
``window_size`` (flash-attn >= 2.1), and return ``lse`` in float32.  Blocks reach them as the pieces of
:func:`.driver.flash2_pieces` (exact under flash-attn 2's window rewrites, and under FlashAttention-3's),
head dims padded to a multiple of 8.  The blocks of a ring step go as one variable-length call per piece
kind (:mod:`.varlen`, ``flash_attn_varlen_func`` and the varlen backward): a packed batch of many documents
costs a few calls, not one per document.

Forward goes through the public ``flash_attn_func``/``flash_attn_varlen_func(..., return_attn_probs=True)``.
Backward needs the private ``_flash_attn_backward``/``_flash_attn_varlen_backward``, whose arguments changed
between releases; every entry point is probed by its signature (forward and backward), never by the version
number: ``window_size=(left, right)`` (2.5; 2.6 adds ``softcap``) or ``window_size_left``/``window_size_right``
(2.7+).  The varlen lse is ``[sequences, h, max_seqlen_q]`` before 2.6 (the release whose varlen backward
has no ``softcap``) and ``[h, total_q]`` from 2.6 on, and in FlashAttention-3.  FlashAttention-3 is used only
with the keyword arguments of its July-2025 interface (otherwise FlashAttention-2 serves).

Import-guarded: without the package ``check`` says "flash-attn is not installed".  Each release's exact
schema is emulated on the CPU (``tests/kernels/flash_attn_releases.py``) through the same code.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types

import torch
from packaging.version import Version

from . import driver, varlen
from .base import BlockArgs, LiveBlock

name = "flash_attn"

_MAX_HEAD_DIM = 256
_FA2_MIN = Version("2.5")
_FA2_FORWARD = {"dropout_p", "softmax_scale", "causal", "window_size", "return_attn_probs"}
_FA2_VARLEN_FORWARD = _FA2_FORWARD | {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
_FA2_BACKWARD = {"dq", "dk", "dv", "dropout_p", "softmax_scale", "causal", "alibi_slopes", "deterministic"}
_FA2_VARLEN_BACKWARD = _FA2_BACKWARD | {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
_FA3_FORWARD = {"softmax_scale", "causal", "window_size", "return_attn_probs"}
_FA3_VARLEN_FORWARD = _FA3_FORWARD | {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
_FA3_BACKWARD_KEYWORDS = {"dq", "dk", "dv", "softmax_scale", "is_causal", "window_size_left", "window_size_right",
                          "cu_seqlens_q", "cu_seqlens_k", "sequed_q", "sequed_k", "max_seqlen_q", "max_seqlen_k"}


def _missing(err: ImportError, package: str) -> bool:
    """The package itself is absent (not one of its compiled parts failing to load)."""
    return isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] == package


def parameters(fn) -> set[str]:
    """Parameter names of ``fn`` (torch.library custom ops keep the decorated function as ``_init_fn``)."""
    return set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


def _lacks(fn, what: str, wanted: set[str]) -> str | None:
    missing = wanted - parameters(fn)
    return f"{what} lacks {sorted(missing)}" if missing else None


def _window_style(params: set[str]) -> str | None:
    """How a flash-attn 2 backward takes the window: ``"split"`` (2.7+), ``"pair"`` (2.5, 2.6), or None."""
    if {"window_size_left", "window_size_right"} <= params:
        return "split"
    return "pair" if "window_size" in params else None


def fa2_entry_points(interface, version: Version) -> types.SimpleNamespace | str:
    """flash-attn 2's four entry points from its interface module, probed by signature, or the reason."""
    funcs = {n: getattr(interface, n, None) for n in (
        "flash_attn_func", "flash_attn_varlen_func", "_flash_attn_backward", "_flash_attn_varlen_backward")}
    absent = [n for n, f in funcs.items() if f is None]
    if absent:
        return f"flash-attn {version} has no {', '.join(absent)}"
    for what, wanted in (("flash_attn_func", _FA2_FORWARD), ("flash_attn_varlen_func", _FA2_VARLEN_FORWARD),
                         ("_flash_attn_backward", _FA2_BACKWARD), ("_flash_attn_varlen_backward", _FA2_VARLEN_BACKWARD)):
        reason = _lacks(funcs[what], f"flash-attn {version}'s {what}", wanted)
        if reason is not None:
            return reason
    dense, packed = parameters(funcs["_flash_attn_backward"]), parameters(funcs["_flash_attn_varlen_backward"])
    if _window_style(dense) is None or _window_style(packed) is None:
        return f"flash-attn {version}'s backward takes neither window_size nor window_size_left/right"
    return types.SimpleNamespace(
        version=version, func=funcs["flash_attn_func"], varlen_func=funcs["flash_attn_varlen_func"],
        backward=funcs["_flash_attn_backward"], varlen_backward=funcs["_flash_attn_varlen_backward"],
        backward_params=dense, varlen_backward_params=packed,
        padded_lse="softcap" not in packed)  # 2.5: varlen lse [n, h, max_q]; 2.6+: [h, total_q]


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
    return fa2_entry_points(interface, version)


def fa3_entry_points(fa3) -> types.ModuleType | str:
    """FlashAttention-3's interface module when its entry points have the July-2025 signatures, else the reason."""
    for what, wanted in (("flash_attn_func", _FA3_FORWARD), ("flash_attn_varlen_func", _FA3_VARLEN_FORWARD),
                         ("_flash_attn_backward", _FA3_BACKWARD_KEYWORDS)):
        fn = getattr(fa3, what, None)
        if fn is None:
            return f"flash_attn_interface has no {what}"
        reason = _lacks(fn, f"flash_attn_interface.{what}", wanted)
        if reason is not None:
            return reason + " (an older FlashAttention-3)"
    return fa3


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
    return fa3_entry_points(fa3)


def _fa2_backward_kwargs(params: set[str], scale: float, causal: bool, left: int, right: int) -> dict:
    """The keyword arguments of a flash-attn 2 backward with parameters ``params`` (dense or varlen)."""
    kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal, alibi_slopes=None, deterministic=False)
    if _window_style(params) == "split":
        kwargs.update(window_size_left=left, window_size_right=right)
    else:
        kwargs.update(window_size=(left, right))
    if "softcap" in params:
        kwargs.update(softcap=0.0)
    return kwargs


class _Blocks:
    """Many blocks per step through the pieces' varlen entry points (:mod:`.varlen`)."""

    head_multiple = 8

    def forward_blocks(self, q, k, v, blocks):
        return varlen.varlen_forward(self.forward_varlen, q, k, v, blocks, driver.flash2_pieces, self.head_multiple)

    def backward_blocks(self, dout, q, k, v, out, lse, blocks):
        return varlen.varlen_backward(self.backward_varlen, dout, q, k, v, out, lse, blocks, driver.flash2_pieces,
                                      self.head_multiple)


class _FlashAttn2Pieces(_Blocks):
    """:class:`.driver.PieceKernel` over flash-attn 2, plus its variable-length calls."""

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
        kwargs = _fa2_backward_kwargs(self.fa2.backward_params, scale, causal, left, right)
        self.fa2.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **kwargs)  # fills dq, dk, dv
        return dq, dk, dv

    def forward_varlen(self, q, k, v, seqs: varlen.VarlenSeqs):
        """q ``[T, h_q, D]``, k/v ``[T_k, h_kv, D]`` → out ``[T, h_q, D]``, lse ``[h_q, T]``."""
        causal, left, right = seqs.kind
        out, lse, _ = self.fa2.varlen_func(
            q, k, v, cu_seqlens_q=seqs.cu_q, cu_seqlens_k=seqs.cu_k, max_seqlen_q=seqs.max_q,
            max_seqlen_k=seqs.max_k, dropout_p=0.0, softmax_scale=seqs.scale, causal=causal,
            window_size=(left, right), return_attn_probs=True,
        )
        return out, (seqs.lse_from_padded(lse) if self.fa2.padded_lse else lse)

    def backward_varlen(self, dout, q, k, v, out, lse, seqs: varlen.VarlenSeqs):
        causal, left, right = seqs.kind
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kwargs = _fa2_backward_kwargs(self.fa2.varlen_backward_params, seqs.scale, causal, left, right)
        lse = seqs.lse_to_padded(lse) if self.fa2.padded_lse else lse  # [n, h, max_q] or [h, T]
        self.fa2.varlen_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=seqs.cu_q,
                                 cu_seqlens_k=seqs.cu_k, max_seqlen_q=seqs.max_q, max_seqlen_k=seqs.max_k, **kwargs)
        return dq, dk, dv


class _FlashAttn3Pieces(_Blocks):
    """:class:`.driver.PieceKernel` over FlashAttention-3, plus its variable-length calls."""

    def __init__(self, fa3: types.ModuleType):
        self.fa3 = fa3

    def forward(self, q, k, v, scale: float, piece: LiveBlock):
        causal, left, right = piece.flash_window()
        out, lse = self.fa3.flash_attn_func(
            q, k, v, softmax_scale=scale, causal=causal, window_size=(left, right), return_attn_probs=True
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale: float, piece: LiveBlock):
        return self._backward(dout, q, k, v, out, lse, scale, piece.flash_window(), {})

    def forward_varlen(self, q, k, v, seqs: varlen.VarlenSeqs):
        causal, left, right = seqs.kind
        out, lse = self.fa3.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=seqs.cu_q, cu_seqlens_k=seqs.cu_k, max_seqlen_q=seqs.max_q,
            max_seqlen_k=seqs.max_k, softmax_scale=seqs.scale, causal=causal, window_size=(left, right),
            return_attn_probs=True,
        )
        return out, lse  # [T, h_q, D], [h_q, T]

    def backward_varlen(self, dout, q, k, v, out, lse, seqs: varlen.VarlenSeqs):
        packed = dict(cu_seqlens_q=seqs.cu_q, cu_seqlens_k=seqs.cu_k, max_seqlen_q=seqs.max_q, max_seqlen_k=seqs.max_k)
        return self._backward(dout, q, k, v, out, lse, seqs.scale, seqs.kind, packed)

    def _backward(self, dout, q, k, v, out, lse, scale: float, kind, packed: dict):
        causal, left, right = kind
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        seqs = dict(dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None), **packed)
        self.fa3._flash_attn_backward(
            dout, q, k, v, out, lse, sequed_q=None, sequed_k=None, dq=dq, dk=dk, dv=dv, softmax_scale=scale,
            is_causal=causal, window_size_left=left, window_size_right=right, softcap=0.0, deterministic=False,
            **seqs,
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
    return driver.flash_limits("flash_attn", available(q.device), q, v, 8, _MAX_HEAD_DIM)


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


@torch.no_grad()
def forward_blocks(q, k, v, blocks) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The blocks of a step (:class:`.varlen.Block`, each accepted by :func:`check`) in one variable-length
    call per piece kind."""
    return _ensure(q, k, v, blocks[0].args).forward_blocks(q, k, v, blocks)


@torch.no_grad()
def backward_blocks(dout, q, k, v, out, lse, blocks) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return _ensure(q, k, v, blocks[0].args).backward_blocks(dout, q, k, v, out, lse, blocks)
