"""AdamW whose state lives off the compute device: in host memory (``host``) or in a file on a local disk
(``disk``), updated chunk by chunk on the CPU (:class:`OffDeviceAdamW`, placed by :class:`OffDeviceSpec`).

The update is PyTorch's single-tensor AdamW (Loshchilov & Hutter, arXiv:1711.05101), element for element in
the same order of operations, so a float32 run equals ``torch.optim.AdamW(foreach=False)`` bit for bit, and
its ``state_dict`` has torch's AdamW layout.  It serves as the inner optimizer of Megatron's
``FP32Optimizer`` / ``Float16OptimizerWithFloat16Params``: clipping, loss scaling and the bf16 master copies
stay Megatron's.  ``disk`` steps in two passes (new moments written and committed, then the parameters
updated from them), so a failed write changes nothing.
The moments' file, the staging and the checkpoints: docs/model-state-offload.md ("The optimizer off the
device").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Iterator
from typing import Any, ContextManager, Optional, Protocol

import torch

from .host_pool import HostPool
from .offload_disk import FLAG as DISK_FLAG
from .offload_disk import RunDir, disk_error, read_file

FLAG = "--longctx-model-state-offload"
TARGETS = ("host", "disk")
STATE_FILE = "adamw-moments.bin"
_ALIGN = 4096  # chunk length multiple (elements): chunks split parameters where torch's vector loops do
_F32 = 4


@dataclasses.dataclass(frozen=True)
class OffDeviceSpec:
    """Where the optimizer's moments live and how it stages them."""

    target: str  # "host" or "disk"
    pool: HostPool  # staging buffers (the host pool's bound)
    disk_dir: Optional[str] = None  # root of the run directory for "disk"
    chunk_numel: int = 1 << 22  # elements per chunk (rounded up to a multiple of 4096)
    source: Any = None  # a ParamSource: parameters whose weights and gradients the step brings in itself
    # the distributed optimizer (model_state_shards): id(parameter) -> the element range [lo, hi) this rank
    # keeps moments for and updates; parameters not in it are whole on every rank
    owned: Any = None

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"{FLAG} {self.target!r}: choose one of {', '.join(TARGETS)}")
        if self.target == "disk" and not self.disk_dir:
            raise ValueError(f"{FLAG} disk needs a directory: set {DISK_FLAG}")
        if self.chunk_numel < 1:
            raise ValueError(f"chunk_numel must be positive, got {self.chunk_numel}")

    @property
    def chunk(self) -> int:
        return -(-self.chunk_numel // _ALIGN) * _ALIGN

    @property
    def buffers(self) -> int:
        """Staging buffers one chunk needs: the denominator, and the two moments for ``disk``."""
        return 3 if self.target == "disk" else 1


class ParamSource(Protocol):
    """Parameters kept off the host between uses (model-state offload to disk): the step brings in one
    group's gradients (pass 1) or weights (pass 2) at a time, so the host holds one group's, never all."""

    def param_groups(self) -> list[list[torch.nn.Parameter]]: ...

    def grads_in(self, index: int) -> ContextManager[list[torch.nn.Parameter]]: ...

    def weights_in(self, index: int) -> ContextManager[list[torch.nn.Parameter]]: ...


class OffDeviceAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments) with its moments off the device.

    The usual ``param_groups`` (``lr``, ``weight_decay``, ``betas``, ``eps`` per group, as Megatron's
    parameter groups set them).  The parameters are the fp32 master weights and must be host tensors (with
    model-state offload Megatron's optimizer sees the off-device copies).  Staging buffers, one chunk each
    (the denominator; for ``disk`` also the two moments read back), come from ``spec.pool``: a pool too
    small for them is refused here.  A failed ``disk`` write leaves the parameters, the step counts and the
    previous moments file as they were, and raises one :class:`DiskOffloadError` naming the flag, the path
    and the bytes.  With ``spec.owned`` (the distributed optimizer) it keeps moments for, and updates, only
    this rank's range of each parameter; its ``state_dict`` then needs every rank's moments gathered first
    (:meth:`set_gathered`).
    """

    def __init__(self, params: Iterable[Any], spec: OffDeviceSpec, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 **unused: Any) -> None:
        for name in ("amsgrad", "maximize", "capturable", "differentiable", "fused"):
            if unused.pop(name, False):
                raise ValueError(f"{FLAG}: the off-device AdamW does not support {name}=True")
        unused.pop("foreach", None)
        if unused:
            raise TypeError(f"unexpected arguments {sorted(unused)}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.spec = spec
        need = spec.buffers * spec.pool.charge(spec.chunk * _F32)
        free = spec.pool.capacity - spec.pool.used  # cached buffers are evicted for it
        if free < need:
            raise ValueError(f"{FLAG} {spec.target}: the staging pool has {free} free of {spec.pool.capacity} "
                             f"bytes; one chunk of {spec.chunk} elements needs {need} bytes ({spec.buffers} "
                             f"buffers): raise --longctx-offload-host-pool-bytes to at least {need + spec.pool.used}")
        if spec.source is not None and spec.target != "disk":
            raise ValueError(f"{FLAG}: parameters brought in by the step need the disk target")
        for p in self._params():
            if p.device.type != "cpu" or p.dtype != torch.float32:
                raise ValueError(f"{FLAG}: the off-device AdamW updates float32 host tensors, got "
                                 f"{p.dtype} on {p.device}; the parameters Megatron's optimizer holds must be "
                                 "the off-device copies")
        self.staging_peak = 0  # most staging bytes held at once (the cost bound)
        self._gathered: Optional[dict[int, tuple[torch.Tensor, torch.Tensor]]] = None  # whole moments, for a save
        self._staged = 0
        self._run_dir = RunDir(spec.disk_dir) if spec.target == "disk" else None
        self._offsets = self._layout()
        # ids of the parameters the source brings in (their gradients and weights are not held here)
        self._sourced = set() if spec.source is None else {id(p) for ps in spec.source.param_groups() for p in ps}

    # ------------------------------------------------------------------ layout and staging
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _range(self, p: torch.Tensor) -> tuple[int, int]:
        """The elements of ``p`` this rank's moments cover (all of them unless the states are sharded)."""
        owned = self.spec.owned
        return owned.get(id(p), (0, p.numel())) if owned is not None else (0, p.numel())

    def _kept(self, p: torch.Tensor) -> int:
        lo, hi = self._range(p)
        return hi - lo

    @property
    def moment_elements(self) -> int:
        """Elements of each moment this rank keeps (the cost the distributed optimizer divides)."""
        return sum(self._kept(p) for p in self._params())

    def _layout(self) -> dict[int, int]:
        """Byte offset of each parameter's ``[exp_avg | exp_avg_sq]`` (of its kept range) in the moments file."""
        offsets, at = {}, 0
        for p in self._params():
            offsets[id(p)] = at
            at += 2 * self._kept(p) * _F32
        self._file_bytes = at
        return offsets

    @property
    def path(self) -> Optional[str]:
        return None if self._run_dir is None else os.path.join(self._run_dir.path, STATE_FILE)

    @contextlib.contextmanager
    def _staging(self) -> Iterator[list[torch.Tensor]]:
        pool, bufs = self.spec.pool, []
        try:
            for _ in range(self.spec.buffers):
                buf = pool.take(self.spec.chunk * _F32)
                if buf is None:
                    raise RuntimeError(f"{FLAG}: the host pool has no room for a staging chunk of "
                                       f"{self.spec.chunk * _F32} bytes ({pool.held} of {pool.capacity} held)")
                bufs.append(buf)
                self._staged += pool.charge(buf.numel())
                self.staging_peak = max(self.staging_peak, self._staged)
            yield [b.view(torch.float32) for b in bufs]
        finally:
            for buf in bufs:
                self._staged -= pool.charge(buf.numel())
                pool.give(buf)

    def _chunks(self, p: torch.Tensor) -> Iterator[tuple[int, int]]:
        """``[lo, hi)`` element ranges of ``p``'s kept range, one staging chunk each."""
        first, last = self._range(p)
        for lo in range(first, last, self.spec.chunk):
            yield lo, min(lo + self.spec.chunk, last)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []  # (group, param, new step count) of every parameter with a gradient
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None and id(p) not in self._sourced:  # a sourced gradient is brought in by the step
                    continue
                if p.grad is not None and p.grad.is_sparse:
                    raise RuntimeError(f"{FLAG}: the off-device AdamW does not take sparse gradients")
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    if self._run_dir is None and self.spec.owned is None:
                        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    elif self._run_dir is None:  # this rank's range only, flat
                        state["exp_avg"] = torch.zeros(self._kept(p), dtype=p.dtype)
                        state["exp_avg_sq"] = torch.zeros(self._kept(p), dtype=p.dtype)
                work.append((group, p, float(state["step"].item()) + 1))
        with self._staging() as bufs:
            if self._run_dir is None:
                for group, p, step in work:
                    state = self.state[p]
                    first = self._range(p)[0]
                    for lo, hi in self._chunks(p):
                        m = state["exp_avg"].view(-1)[lo - first:hi - first]
                        v = state["exp_avg_sq"].view(-1)[lo - first:hi - first]
                        _moments(group, p.grad.reshape(-1)[lo:hi], m, v)
                        _update(group, step, p.view(-1)[lo:hi], m, v, bufs[0][:hi - lo])
                    state["step"].fill_(step)
            else:
                self._disk_step(work, bufs)
        return loss

    def _blocks(self, weights: bool) -> Iterator[list[torch.Tensor]]:
        """This optimizer's parameters a block at a time: each source group with its gradients (or weights)
        brought in for the block, then the parameters no source holds."""
        mine = {id(p) for p in self._params()}
        source = self.spec.source
        if source is not None:
            for i, ps in enumerate(source.param_groups()):
                ps = [p for p in ps if id(p) in mine]
                if ps:
                    with (source.weights_in(i) if weights else source.grads_in(i)):
                        yield ps
        rest = [p for p in self._params() if id(p) not in self._sourced]
        if rest:
            yield rest

    def _disk_step(self, work: list, bufs: list[torch.Tensor]) -> None:
        m_buf, v_buf, denom = bufs
        stepped = {id(p): (group, step) for group, p, step in work}
        old = self.path if os.path.exists(self.path) else None
        with self._writer() as write:  # pass 1: new moments into the temporary file, committed at exit
            for block in self._blocks(weights=False):
                for p in block:
                    base, (first, _), kept = self._offsets[id(p)], self._range(p), self._kept(p)
                    for lo, hi in self._chunks(p):
                        m, v = self._read(old, p, lo, hi, m_buf, v_buf)
                        if id(p) in stepped and p.grad is not None:
                            _moments(stepped[id(p)][0], p.grad.reshape(-1)[lo:hi], m, v)
                        write(m, base + (lo - first) * _F32)
                        write(v, base + (kept + lo - first) * _F32)
        for block in self._blocks(weights=True):  # pass 2: the parameters from the committed moments
            for p in block:
                if id(p) not in stepped:
                    continue
                group, step = stepped[id(p)]
                for lo, hi in self._chunks(p):
                    m, v = self._read(self.path, p, lo, hi, m_buf, v_buf)
                    _update(group, step, p.view(-1)[lo:hi], m, v, denom[:hi - lo])
                self.state[p]["step"].fill_(step)

    def _read(self, path: Optional[str], p: torch.Tensor, lo: int, hi: int, m_buf: torch.Tensor,
              v_buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk ``[lo, hi)`` of ``p``'s two moments from ``path`` into the staging buffers (zeros: no file)."""
        m, v = m_buf[:hi - lo], v_buf[:hi - lo]
        if path is None or "step" not in self.state.get(p, {}):
            m.zero_()
            v.zero_()
            return m, v
        base, n, first = self._offsets[id(p)], (hi - lo) * _F32, self._range(p)[0]
        read_file(path, n, base + (lo - first) * _F32, out=m.view(torch.uint8))
        read_file(path, n, base + (self._kept(p) + lo - first) * _F32, out=v.view(torch.uint8))
        return m, v

    @contextlib.contextmanager
    def _writer(self) -> Iterator[Any]:
        """``write(tensor, offset)`` into ``<file>.tmp``; fsynced and renamed over ``<file>`` on success, removed
        (the previous file untouched) on failure."""
        tmp = self.path + ".tmp"
        fd = None
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

            def write(t: torch.Tensor, offset: int) -> None:
                view = memoryview(t.view(torch.uint8).numpy())
                done = 0
                while done < len(view):
                    done += os.pwrite(fd, view[done:], offset + done)

            yield write
            os.fsync(fd)
            os.close(fd)
            fd = None
            os.rename(tmp, self.path)
            dir_fd = os.open(os.path.dirname(self.path), os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise disk_error(f"writing {self._file_bytes} bytes of optimizer state ({FLAG} disk) to", tmp,
                             exc) from exc

    # ------------------------------------------------------------------ checkpoints
    def kept_moments(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``p``'s two moments over this rank's range, flat (copies read from the file for ``disk``; zeros
        before its first step)."""
        if "step" not in self.state.get(p, {}):
            return torch.zeros(self._kept(p)), torch.zeros(self._kept(p))
        if self._run_dir is None:
            state = self.state[p]
            return state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        m, v = torch.empty(self._kept(p)), torch.empty(self._kept(p))
        base, n = self._offsets[id(p)], self._kept(p) * _F32
        if n:
            read_file(self.path, n, base, out=m.view(torch.uint8))
            read_file(self.path, n, base + n, out=v.view(torch.uint8))
        return m, v

    def set_gathered(self, moments: Optional[dict[int, tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Every rank's moments of each parameter (``id -> (exp_avg, exp_avg_sq)``, whole), for the next
        :meth:`state_dict` of a sharded optimizer; None drops them."""
        self._gathered = moments

    def state_dict(self) -> dict[str, Any]:
        """torch's AdamW layout: ``step``, ``exp_avg``, ``exp_avg_sq`` per parameter (read from the file for
        ``disk``; gathered from every rank when sharded)."""
        sd = super().state_dict()
        if self._run_dir is None and self.spec.owned is None:
            return sd
        stepped = any("step" in self.state.get(p, {}) for p in self._params())
        if self.spec.owned is not None and self._gathered is None and stepped:
            raise RuntimeError(f"{FLAG}: this rank keeps Adam's moments for its share of each parameter only; a "
                               "checkpoint gathers every rank's first (the plugin wraps Megatron's save_checkpoint "
                               "to do it)")
        index = {id(p): i for i, p in enumerate(self._params())}
        for p in self._params():
            if "step" not in self.state.get(p, {}):
                continue
            m, v = self._gathered[id(p)] if self._gathered is not None else self.kept_moments(p)
            sd["state"][index[id(p)]] = {"step": self.state[p]["step"].clone(), "exp_avg": m.view_as(p),
                                         "exp_avg_sq": v.view_as(p)}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's AdamW layout, whole moments per parameter; a sharded optimizer keeps its range of them."""
        super().load_state_dict(state_dict)
        if self._run_dir is None:
            for p in self._params():
                state = self.state.get(p, {})
                if self.spec.owned is not None and "exp_avg" in state:
                    lo, hi = self._range(p)
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = state[key].detach().float().reshape(-1)[lo:hi].clone()
            return
        with self._writer() as write:
            for p in self._params():
                state = self.state.get(p, {})
                base, kept, (lo, hi) = self._offsets[id(p)], self._kept(p), self._range(p)
                for key, at in (("exp_avg", base), ("exp_avg_sq", base + kept * _F32)):
                    t = state.pop(key, None)
                    write(torch.zeros(kept) if t is None else t.detach().float().reshape(-1)[lo:hi].contiguous(), at)

    def close(self) -> None:
        """Remove the run directory (``disk``)."""
        if self._run_dir is not None:
            self._run_dir.remove()


def _moments(group: dict, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
    """Adam's moment updates of one chunk, in place (torch's ``_single_tensor_adam`` operations)."""
    beta1, beta2 = group["betas"]
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)


def _update(group: dict, step: float, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
            denom: torch.Tensor) -> None:
    """The decoupled decay and the bias-corrected step of one chunk of ``p`` (``denom``: scratch, like ``p``)."""
    beta1, beta2 = group["betas"]
    lr, wd = group["lr"], group["weight_decay"]
    if wd != 0:
        p.mul_(1 - lr * wd)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    torch.sqrt(v, out=denom)
    denom.div_(bias_correction2**0.5).add_(group["eps"])
    p.addcdiv_(m, denom, value=-step_size)

