"""CPU stand-ins for the flash-attn package's entry points, one set per release, with each release's exact
parameter lists (``flash_attn/flash_attn_interface.py`` at v2.5.0, v2.6.3, v2.7.4 and v2.8.3;
``hopper/flash_attn_interface.py`` of FlashAttention-3 since July 2025), computing in float64 through
:mod:`.flash_emulation` with each one's window rewrites and lse layouts:

* 2.5: varlen lse ``[sequences, h, max_seqlen_q]`` (per sequence, padded), backward ``window_size=(l, r)``;
* 2.6: varlen lse ``[h, total_q]``, backward ``window_size`` and ``softcap``;
* 2.7, 2.8: backward ``window_size_left``/``window_size_right`` and ``softcap``;
* FlashAttention-3: one ``_flash_attn_backward`` for dense and varlen, its own rewrites
  (:func:`.flash_emulation.fa3_visible`), lse ``[h, total_q]``.

Backwards fill ``dq``/``dk``/``dv`` in place as the real ones do.  Every call is counted per kind.
"""

from __future__ import annotations

import collections
import types

import torch

from . import flash_emulation as emu

CALLS: collections.Counter = collections.Counter()


def _fill(bufs, grads):
    for buf, g in zip(bufs, grads):
        buf.copy_(g)


def _padded_lse(lse_flat, cu_q, max_q):
    """``[h, T]`` -> ``[n, h, max_q]`` as flash-attn 2.5's varlen forward returns it (rows past the end: garbage)."""
    cu = cu_q.tolist()
    out = torch.full((len(cu) - 1, lse_flat.shape[0], max_q), 12345.0, dtype=lse_flat.dtype)
    for i, (a, b) in enumerate(zip(cu, cu[1:])):
        out[i, :, : b - a] = lse_flat[:, a:b]
    return out


def _flat_lse(lse_padded, cu_q):
    assert lse_padded.dim() == 3 and lse_padded.is_contiguous()
    cu = cu_q.tolist()
    return torch.cat([lse_padded[i, :, : b - a] for i, (a, b) in enumerate(zip(cu, cu[1:]))], dim=-1)


# ---- flash-attn 2.5.0 -------------------------------------------------------------------------------------
def v250_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         alibi_slopes=None, deterministic=False, return_attn_probs=False):
    CALLS["forward"] += 1
    assert dropout_p == 0.0 and alibi_slopes is None
    out, lse = emu.dense_forward(q, k, v, causal, softmax_scale, *window_size)
    return (out, lse, None) if return_attn_probs else out


def v250_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                                deterministic=False, return_attn_probs=False):
    CALLS["varlen_forward"] += 1
    assert dropout_p == 0.0 and alibi_slopes is None
    out, lse = emu.packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  softmax_scale, *window_size)
    lse = _padded_lse(lse, cu_seqlens_q, max_seqlen_q)
    return (out, lse, None) if return_attn_probs else out


def v250_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, alibi_slopes, deterministic, rng_state=None):
    CALLS["backward"] += 1
    _fill((dq, dk, dv), emu.dense_backward(dout, q, k, v, out, softmax_lse, causal, softmax_scale, *window_size))


def v250_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                    alibi_slopes, deterministic, rng_state=None):
    CALLS["varlen_backward"] += 1
    assert softmax_lse.shape == (cu_seqlens_q.numel() - 1, q.shape[1], max_seqlen_q)  # the padded layout
    lse = _flat_lse(softmax_lse, cu_seqlens_q)
    _fill((dq, dk, dv), emu.packed_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, causal, softmax_scale, *window_size))


# ---- flash-attn 2.6.3 -------------------------------------------------------------------------------------
def v263_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                         alibi_slopes=None, deterministic=False, return_attn_probs=False):
    assert softcap == 0.0
    return v250_flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                return_attn_probs)


def v263_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                deterministic=False, return_attn_probs=False, block_table=None):
    CALLS["varlen_forward"] += 1
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and block_table is None
    out, lse = emu.packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  softmax_scale, *window_size)
    return (out, lse, None) if return_attn_probs else out


def v263_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, rng_state=None):
    assert softcap == 0.0
    v250_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, alibi_slopes, deterministic)


def v263_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, deterministic, rng_state=None):
    CALLS["varlen_backward"] += 1
    assert softcap == 0.0 and softmax_lse.shape == (q.shape[1], q.shape[0])  # [h, total_q]
    _fill((dq, dk, dv), emu.packed_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q, max_seqlen_k, causal, softmax_scale, *window_size))


# ---- flash-attn 2.7.4 / 2.8.3 (the same Python signatures for these four) -------------------------------
def v27_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                            window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    v263_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             (window_size_left, window_size_right), softcap, alibi_slopes, deterministic)


def v27_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                   max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                   window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    v263_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                    (window_size_left, window_size_right), softcap, alibi_slopes, deterministic)


def _interface(**funcs) -> types.SimpleNamespace:
    return types.SimpleNamespace(**funcs)


_V263_FORWARD = dict(flash_attn_func=v263_flash_attn_func, flash_attn_varlen_func=v263_flash_attn_varlen_func)
FA2_RELEASES = {
    "2.5.0": _interface(flash_attn_func=v250_flash_attn_func, flash_attn_varlen_func=v250_flash_attn_varlen_func,
                        _flash_attn_backward=v250_flash_attn_backward,
                        _flash_attn_varlen_backward=v250_flash_attn_varlen_backward),
    "2.6.3": _interface(**_V263_FORWARD, _flash_attn_backward=v263_flash_attn_backward,
                        _flash_attn_varlen_backward=v263_flash_attn_varlen_backward),
    # 2.7 changed the backward's signatures; 2.8 kept 2.7's
    **{release: _interface(**_V263_FORWARD, _flash_attn_backward=v27_flash_attn_backward,
                           _flash_attn_varlen_backward=v27_flash_attn_varlen_backward) for release in ("2.7.4", "2.8.3")},
}


# ---- FlashAttention-3 (hopper/flash_attn_interface.py, July 2025 on) --------------------------------------
def fa3_flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                        v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                        pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    CALLS["forward"] += 1
    out, lse = emu.dense_forward(q, k, v, causal, softmax_scale, *window_size, visible=emu.fa3_visible)
    return (out, lse) if return_attn_probs else out


def fa3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                               seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None,
                               k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                               num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False):
    CALLS["varlen_forward"] += 1
    assert seqused_q is None and seqused_k is None
    out, lse = emu.packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                  softmax_scale, *window_size, visible=emu.fa3_visible)
    return (out, lse) if return_attn_probs else out


def fa3_flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                            sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
                            softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1,
                            softcap=0.0, deterministic=False, sm_margin=0):
    assert sequed_q is None and sequed_k is None and softcap == 0.0
    if cu_seqlens_q is None:
        CALLS["backward"] += 1
        grads = emu.dense_backward(dout, q, k, v, out, softmax_lse, is_causal, softmax_scale, window_size_left,
                                   window_size_right, visible=emu.fa3_visible)
    else:
        CALLS["varlen_backward"] += 1
        grads = emu.packed_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, is_causal, softmax_scale, window_size_left, window_size_right,
                                    visible=emu.fa3_visible)
    _fill((dq, dk, dv), grads)


def fa3_backward_feb_2025(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                          max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
                          sink_token_length=0, softcap=0.0, deterministic=False, sm_margin=0):
    raise AssertionError("must not be called")


FA3 = _interface(flash_attn_func=fa3_flash_attn_func, flash_attn_varlen_func=fa3_flash_attn_varlen_func,
                 _flash_attn_backward=fa3_flash_attn_backward)


def fa2_kernel(release: str):
    """The flash_attn backend's piece kernel over flash-attn ``release``'s stand-ins (probed as the real ones)."""
    from packaging.version import Version

    from megatron_longctx.kernels import flash_attn

    fa2 = flash_attn.fa2_entry_points(FA2_RELEASES[release], Version(release))
    assert not isinstance(fa2, str), fa2
    return flash_attn._FlashAttn2Pieces(fa2)


def fa3_kernel():
    from megatron_longctx.kernels import flash_attn

    fa3 = flash_attn.fa3_entry_points(FA3)
    assert not isinstance(fa3, str), fa3
    return flash_attn._FlashAttn3Pieces(fa3)
