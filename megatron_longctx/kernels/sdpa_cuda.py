"""Block attention on NVIDIA GPUs through PyTorch's own FlashAttention-2 (no extra package).

Uses ``aten::_flash_attention_forward`` / ``aten::_flash_attention_backward``: the ops under torch's
SDPA flash path (``_scaled_dot_product_flash_attention`` only transposes ``[b, h, s, d]`` to them).
They take our ``[b, s, h, d]`` layout directly, return ``lse`` ``[b, h_q, s_q]`` in float32, accept
k/v with fewer heads (GQA/MQA, the kernel of Dao 2023), and, where their schemas carry
``window_size_left``/``window_size_right`` (torch 2.13 and 2.14 do), serve every
:class:`~.base.BlockMask` as a bottom-right aligned window on the pieces of
:func:`.driver.flash2_pieces`; without them only unmasked and causal pieces are served.  The dense (non-varlen)
backward gets ``None`` for ``cum_seq_q``/``cum_seq_k`` and, as dropout is off, placeholder RNG
tensors, the way ``torch.nn.attention.varlen`` calls it.  The blocks of a step go as one variable-length
call (``cum_seq_q``/``cum_seq_k``, ``[T, h, D]`` rows end to end, lse ``[h, T]``) per piece kind
(:mod:`.varlen`): a packed batch of many documents costs a few calls, not one per document.

The other SDPA kernels that return a logsumexp are not used: the memory-efficient kernel pads its
lse to 32-row tiles, expresses masks only as a dense bias and needs equal head counts; cuDNN's has
no window arguments.  fp16/bf16 only, head dims up to 256 (after padding to a multiple of 8),
sm80 or newer.  float32 blocks on CUDA are refused in automatic selection (:mod:`.select`).
"""

from __future__ import annotations

import functools

import torch

from . import driver, varlen
from .base import BlockArgs, KernelUnsupported, LiveBlock

name = "sdpa_cuda"

_MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=None)
def window_args_supported() -> bool:
    """Whether this torch's flash ops take ``window_size_left``/``window_size_right``."""
    ops = (torch.ops.aten._flash_attention_forward.default, torch.ops.aten._flash_attention_backward.default)
    return all({"window_size_left", "window_size_right"} <= {a.name for a in op._schema.arguments} for op in ops)


class FlashOpPieces:
    """:class:`.driver.PieceKernel` over ``_flash_attention_forward``/``_backward``-shaped ops.

    ``fwd_op``/``bwd_op`` are the aten ops in production; tests substitute CPU emulations with the
    same signatures to check the piece/window arithmetic without a GPU.
    """

    head_multiple = 8

    def __init__(self, fwd_op, bwd_op, windows: bool):
        self.fwd_op, self.bwd_op, self.windows = fwd_op, bwd_op, windows

    def _mask_args(self, piece: LiveBlock) -> tuple[bool, dict]:
        return self._kind_args(piece.flash_window())

    def forward(self, q, k, v, scale: float, piece: LiveBlock):
        causal, windows = self._mask_args(piece)
        # q [b, s_q, h_q, D], k/v [b, s_k, h_kv, D]; no cum_seq: the dense batch path
        s_q, s_k = q.shape[1], k.shape[1]
        out, lse = self.fwd_op(q, k, v, None, None, s_q, s_k, 0.0, causal, False, scale=scale, **windows)[:2]
        return out, lse  # [b, s_q, h_q, D], [b, h_q, s_q] float32

    def backward(self, dout, q, k, v, out, lse, scale: float, piece: LiveBlock):
        causal, windows = self._mask_args(piece)
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # unused: dropout is 0
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = self.bwd_op(
            dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.0, causal, rng_state, unused,
            scale=scale, **windows,
        )
        return dq, dk, dv

    def _kind_args(self, kind: tuple[bool, int, int]) -> tuple[bool, dict]:
        causal, left, right = kind
        if causal or (left, right) == (-1, -1):
            return causal, {}
        if not self.windows:
            raise KernelUnsupported(f"{name}: this torch's flash ops have no window arguments (window {kind[1:]})")
        return False, {"window_size_left": left, "window_size_right": right}

    def forward_varlen(self, q, k, v, seqs: varlen.VarlenSeqs):
        """q ``[T, h_q, D]``, k/v ``[T_k, h_kv, D]`` with ``cu_seqlens`` → out ``[T, h_q, D]``, lse ``[h_q, T]``."""
        causal, windows = self._kind_args(seqs.kind)
        out, lse = self.fwd_op(q, k, v, seqs.cu_q, seqs.cu_k, seqs.max_q, seqs.max_k, 0.0, causal, False,
                               scale=seqs.scale, **windows)[:2]
        return out, lse

    def backward_varlen(self, dout, q, k, v, out, lse, seqs: varlen.VarlenSeqs):
        causal, windows = self._kind_args(seqs.kind)
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # unused: dropout is 0
        unused = torch.empty(0, device=q.device)
        return self.bwd_op(dout, q, k, v, out, lse, seqs.cu_q, seqs.cu_k, seqs.max_q, seqs.max_k, 0.0, causal,
                           rng_state, unused, scale=seqs.scale, **windows)

    def forward_blocks(self, q, k, v, blocks):
        """Every block's (out, lse), one variable-length call per piece kind (:mod:`.varlen`)."""
        return varlen.varlen_forward(self.forward_varlen, q, k, v, blocks, driver.flash2_pieces, self.head_multiple)

    def backward_blocks(self, dout, q, k, v, out, lse, blocks):
        return varlen.varlen_backward(self.backward_varlen, dout, q, k, v, out, lse, blocks, driver.flash2_pieces,
                                      self.head_multiple)


@functools.lru_cache(maxsize=None)
def _kernel() -> FlashOpPieces:
    return FlashOpPieces(
        torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward, window_args_supported()
    )


def available(device: torch.device) -> str | None:
    """``None`` when the backend can run on ``device`` at all, else the reason."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"sdpa_cuda needs CUDA tensors, not {device}"
    if torch.version.hip is not None:
        return "sdpa_cuda is written for NVIDIA builds of torch; ROCm's flash ops differ"
    if not torch.cuda.is_available():
        return "sdpa_cuda: CUDA is not available"
    return None


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: BlockArgs) -> str | None:
    reason = driver.flash_limits("sdpa_cuda (flash)", available(q.device), q, v, FlashOpPieces.head_multiple,
                                 _MAX_HEAD_DIM)
    if reason is not None:
        return reason
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "sdpa_cuda (flash) needs an sm80 or newer GPU"
    if not window_args_supported():
        for piece in driver.flash2_pieces(args, q.shape[1], k.shape[1]):
            causal, left, right = piece.flash_window()
            if not causal and (left, right) != (-1, -1):
                return "sdpa_cuda: this torch's flash ops have no window arguments; the block needs a window"
    return None


@torch.no_grad()
def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, args: BlockArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Block forward (layouts in :mod:`.base`): out ``[b, s_q, h_q, d_v]``, lse ``[b, h_q, s_q]``."""
    driver.require(check(q, k, v, args))
    return driver.forward(_kernel(), driver.flash2_pieces(args, q.shape[1], k.shape[1]), q, k, v, args)


@torch.no_grad()
def backward(dout, q, k, v, out, lse, args: BlockArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block backward given the final ``out``/``lse`` of each row (FlashAttention-2 backward)."""
    driver.require(check(q, k, v, args))
    pieces = driver.flash2_pieces(args, q.shape[1], k.shape[1])
    return driver.backward(_kernel(), pieces, dout, q, k, v, out, lse, args)


@torch.no_grad()
def forward_blocks(q, k, v, blocks) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The blocks of a step (:class:`.varlen.Block`, each accepted by :func:`check`) in one variable-length
    call per piece kind: a pack of documents costs a few kernel calls, not one per document."""
    return _kernel().forward_blocks(q, k, v, blocks)


@torch.no_grad()
def backward_blocks(dout, q, k, v, out, lse, blocks) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    return _kernel().backward_blocks(dout, q, k, v, out, lse, blocks)
