"""Faults planted into the code the gpu_check dry run exercises, each a context manager that undoes itself.

* ``nan_grad_cpu_flash``: a NaN in one dk entry of every ``cpu_flash`` backward (the CPU backend);
* ``nan_grad_varlen``: a NaN in one dq entry of every variable-length backward of the CUDA backends'
  CPU emulations (torch's flash ops, flash-attn 2.5-2.8, FlashAttention-3: the packed section's);
* ``inf_lse``: ``+inf`` for one finite lse entry of every ``cpu_flash`` forward;
* ``dropped_ring_step``: the ring schedule loses its last step (``schedule.ring_schedule``);
* ``skipped_case``: the time budget runs out for exactly one kernel case.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _nan_in(grads, which: int):
    grads = list(grads)
    if grads[which].numel():
        grads[which] = grads[which].clone()
        grads[which].view(-1)[0] = float("nan")
    return tuple(grads)


@contextlib.contextmanager
def nan_grad_cpu_flash():
    from megatron_longctx.kernels import cpu_flash

    real = cpu_flash.backward

    @functools.wraps(real)
    def backward(*args, **kwargs):
        return _nan_in(real(*args, **kwargs), 1)

    with _replaced(cpu_flash, "backward", backward):
        yield


@contextlib.contextmanager
def nan_grad_varlen():
    from tests.kernels import flash_emulation

    real = flash_emulation.packed_backward

    @functools.wraps(real)
    def backward(*args, **kwargs):
        return _nan_in(real(*args, **kwargs), 0)

    with _replaced(flash_emulation, "packed_backward", backward):
        yield


@contextlib.contextmanager
def inf_lse():
    from megatron_longctx.kernels import cpu_flash

    real = cpu_flash.forward

    @functools.wraps(real)
    def forward(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        finite = torch.isfinite(lse).view(-1).nonzero()
        if finite.numel():
            lse = lse.clone()
            lse.view(-1)[finite[0, 0]] = float("inf")
        return out, lse

    with _replaced(cpu_flash, "forward", forward):
        yield


@contextlib.contextmanager
def dropped_ring_step():
    from megatron_longctx.attention import schedule

    real = schedule.ring_schedule

    @functools.wraps(real)
    def ring_schedule(layout, mask):
        plan = real(layout, mask)
        if len(plan.offsets) < 2:
            return plan
        return dataclasses.replace(plan, offsets=plan.offsets[:-1], calls=plan.calls[:-1])

    with _replaced(schedule, "ring_schedule", ring_schedule):
        yield


@contextlib.contextmanager
def skipped_case():
    """The kernels section's budget is gone for its second case only (``Budget.left`` is asked once per case)."""
    import gpu_check_attention

    real = gpu_check_attention.Budget
    asked = {"n": 0}

    class Budget(real):
        def left(self):
            asked["n"] += 1
            return -1.0 if asked["n"] == 2 else super().left()

    import gpu_check

    with _replaced(gpu_check, "Budget", Budget):
        yield


FAULTS = {"nan_grad_cpu_flash": nan_grad_cpu_flash, "nan_grad_varlen": nan_grad_varlen, "inf_lse": inf_lse,
          "dropped_ring_step": dropped_ring_step, "skipped_case": skipped_case}
