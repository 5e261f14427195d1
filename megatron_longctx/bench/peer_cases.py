"""One measurement of one implementation, run in a fresh process (or a fresh pair of gloo ranks).

Each case first runs a small check shape against a float64 reference (this is also the warm-up: lazy
initialisation belongs to no measured call), then one forward + backward at the measured shape:
process CPU-seconds and the peak resident memory that call added (``memory.accounting.PeakMemory``:
sampled RSS bounded by ``ru_maxrss``), per rank; then :data:`STEADY_STEPS` more calls, timed alone (the
steady state of a training loop, without a process's first call at the shape).  Implementations:

- attention (2 gloo ranks, causal, ``[s/p, b, h, d]``): ``ours-ulysses`` and ``ours-ring``
  (:func:`megatron_longctx.attention.cp_attention`, Megatron's load-balanced shards), ``deepspeed-ulysses``
  (``deepspeed.sequence.layer.DistributedAttention`` over torch SDPA, contiguous shards);
- tiled MLP (one process, SwiGLU ``[s, b, h]``): ``ours-tiled-mlp`` and ``alst-tiled-mlp``
  (``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP``);
- tiled logits + loss (one process, mean token loss): ``ours-tiled-loss`` and ``alst-tiled-loss``
  (``TiledFusedLogitsLoss`` over ``F.cross_entropy``);
- ``torch-context-parallel`` (2 gloo ranks): torch's ``context_parallel`` around SDPA.

:func:`interleaved_rank` times the implementations of one shape in turn in the same process (pair of
ranks), one call each per round: the per-round ratios compare calls that met the same machine state.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTENTION = ("ours-ulysses", "ours-ring", "deepspeed-ulysses")
TILED_MLP = ("ours-tiled-mlp", "alst-tiled-mlp")
TILED_LOSS = ("ours-tiled-loss", "alst-tiled-loss")
TORCH_CP = "torch-context-parallel"
CHECK_SEQ = 512  # the float64 check (and warm-up) shape
STEADY_STEPS = 3  # timed calls after the measured one (their median is the steady-state time)


def peer_unavailable(impl: str) -> str | None:
    """Why ``impl`` cannot run here (``None`` when it can): the peer package is missing or broken."""
    if not (impl.startswith("deepspeed") or impl.startswith("alst")):
        return None
    try:
        if impl.startswith("deepspeed"):
            from deepspeed.sequence.layer import DistributedAttention  # noqa: F401
        else:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure makes the peer unavailable, with its reason
        return f"deepspeed not importable ({type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}); " \
               "install it with pip install 'megatron-longctx[peers]'"
    return None


def _measure(step: Callable[[], None]) -> dict[str, float]:
    from megatron_longctx.memory.accounting import PeakMemory

    gc.collect()
    with PeakMemory(torch.device("cpu")) as peak:
        start = time.process_time()
        step()
        cpu = time.process_time() - start
    return {"cpu_s": cpu, "peak_added_bytes": float(peak.added_bytes)}


def _steady(step: Callable[[], None], leaves: list[torch.Tensor], group: Any = None,
            calls: int = STEADY_STEPS) -> list[float]:
    """CPU-seconds of ``calls`` more calls of ``step`` (the gradients of ``leaves`` cleared before each, ranks
    of ``group`` lined up by a barrier when given)."""
    times = []
    for _ in range(calls):
        for x in leaves:
            x.grad = None
        gc.collect()
        if group is not None:
            dist.barrier(group)
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return times


def _max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


# ---------------------------------------------------------------------------------------- attention
def _attention_fn(impl: str, group: Any) -> tuple[Callable, Callable]:
    """(attention on local ``[s/p, b, h, d]`` shards, the shard function of its sequence layout)."""
    from megatron_longctx.attention import cp_attention, shard_sequence

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    zigzag = lambda x: shard_sequence(x, rank, world, seq_dim=0)  # noqa: E731 - Megatron's layout
    if impl.startswith("ours-"):
        algorithm = impl.split("-", 1)[1]
        return (lambda q, k, v: cp_attention(q, k, v, group, algorithm=algorithm, causal=True)), zigzag
    import deepspeed.comm as ds_comm
    from deepspeed.sequence.layer import DistributedAttention

    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # [s, b, h/p, d] -> [b, h/p, s, d] -> SDPA -> [s, b, h/p, d]
        out = F.scaled_dot_product_attention(*(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=True,
                                             enable_gqa=True)
        return out.permute(2, 0, 1, 3)

    layer = DistributedAttention(sdpa, group, scatter_idx=2, gather_idx=0)
    contiguous = lambda x: x.chunk(world, dim=0)[rank]  # noqa: E731 - DeepSpeed's layout
    return (lambda q, k, v: layer(q, k, v, batch_dim_idx=1)), contiguous


def _attention_inputs(s: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(s, 1, hq, d), (s, 1, hkv, d), (s, 1, hkv, d), (s, 1, hq, d)]  # q, k, v, d out: [s, b, h, d]
    return [torch.randn(shape, generator=g, dtype=torch.float64).to(dtype) for shape in shapes]


def _attention_reference(q, k, v, dout) -> tuple[torch.Tensor, ...]:
    """float64 causal attention over the whole sequence; (out, dq, dk, dv) ``[s, b, h, d]``."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(*(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=True,
                                         enable_gqa=True).permute(2, 0, 1, 3)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _attention_step(case: dict[str, Any], fn: Callable, shard: Callable) -> tuple[Callable[[], None], list]:
    """(one forward + backward at the measured shape, its leaves): only this rank's shards stay alive."""
    glob = _attention_inputs(case["seq"], case["hq"], case["hkv"], case["d"], torch.float32, case["seed"] + 1)
    q, k, v, dout = (shard(x).clone() for x in glob)
    del glob
    for x in (q, k, v):
        x.requires_grad_()

    def step() -> None:
        fn(q, k, v).backward(dout)

    return step, [q, k, v]


def attention_rank(case: dict[str, Any]) -> dict[str, Any]:
    """One attention case on this rank (inside an initialised gloo group)."""
    torch.set_num_threads(1)
    group = dist.group.WORLD
    fn, shard = _attention_fn(case["impl"], group)
    hq, hkv, d = case["hq"], case["hkv"], case["d"]
    # float64 check at CHECK_SEQ tokens (also the warm-up)
    glob = _attention_inputs(CHECK_SEQ, hq, hkv, d, torch.float32, case["seed"])
    ref = _attention_reference(*glob)
    q, k, v = (shard(x).clone().requires_grad_() for x in glob[:3])
    out = fn(q, k, v)
    out.backward(shard(glob[3]))
    errors = [_max_err(got, shard(r)) for got, r in zip((out, q.grad, k.grad, v.grad), ref)]
    del glob, ref, q, k, v, out
    step, leaves = _attention_step(case, fn, shard)
    dist.barrier()
    measured = _measure(step)
    return {**measured, "cpu_s_steps": _steady(step, leaves, group), "max_rel_err": max(errors)}


# ---------------------------------------------------------------------------------------- tiled MLP
class _SwiGLU(torch.nn.Module):
    """Llama's MLP on ``[..., h]``: ``down(silu(gate(x)) * up(x))``, over the ``[tokens, h]`` rows as
    Megatron's linears compute (torch's backward of a 3-d ``F.linear`` holds one more ``[tokens, h]``
    gradient than the 2-d one, which ALST's tiles are)."""

    def __init__(self, h: int, ffn: int, dtype: torch.dtype, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate, self.up, self.down = (torch.nn.Parameter(torch.randn(shape, generator=g, dtype=torch.float64)
                                                            .mul_(shape[1] ** -0.5).to(dtype))
                                         for shape in ((ffn, h), (ffn, h), (h, ffn)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [tokens, h]
        return F.linear(F.silu(F.linear(rows, self.gate)) * F.linear(rows, self.up), self.down).view(x.shape)


def _mlp_fn(impl: str, mlp: _SwiGLU, shards: int) -> Callable[[torch.Tensor], torch.Tensor]:
    if impl == "ours-tiled-mlp":
        from megatron_longctx.memory.tiled_mlp import tiled_mlp

        return lambda x: tiled_mlp(lambda t: (mlp(t), None), x, shards)[0]  # x [s, b, h]
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    params = list(mlp.parameters())
    # ALST chunks dim -2: [b, s, h]; ours tiles dim 0 of [s, b, h]
    return lambda x: TiledMLP.apply(lambda self, t: self(t), mlp, x.transpose(0, 1), shards, params).transpose(0, 1)


def _loss_fn(impl: str, weight: torch.Tensor, shards: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Mean token cross-entropy of ``hidden`` ``[s, b, h]`` against ``labels`` ``[b, s]``."""
    if impl == "ours-tiled-loss":
        from megatron_longctx.memory.tiled_loss import TiledLossArgs, tiled_logits_loss

        return lambda x, y: tiled_logits_loss(x, weight, y, TiledLossArgs(shards)).mean()
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    head = torch.nn.Module()

    def fn(self: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # x [n, h], y [n]
        return F.cross_entropy(F.linear(x, weight), y)

    return lambda x, y: TiledFusedLogitsLoss.apply(fn, head, x.transpose(0, 1), y, None, shards, [weight], "mean")


def _tiled_build(case: dict[str, Any], dtype: torch.dtype) -> tuple[Callable, list[torch.Tensor]]:
    """(the implementation ``case["impl"]`` as a function, its parameters) in ``dtype``."""
    impl, h = case["impl"], case["hidden"]
    if impl in TILED_MLP:
        mlp = _SwiGLU(h, case["ffn"], dtype, case["seed"])
        return _mlp_fn(impl, mlp, case["shards"]), list(mlp.parameters())
    g = torch.Generator().manual_seed(case["seed"])
    weight = torch.nn.Parameter(torch.randn(case["vocab"], h, generator=g, dtype=torch.float64).to(dtype))
    return _loss_fn(impl, weight, case["shards"]), [weight]


def _tiled_inputs(case: dict[str, Any], s: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, Any]:
    """(x ``[s, b, h]``, the gradient of the MLP's output or the loss's labels ``[b, s]``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, 1, case["hidden"], generator=g, dtype=torch.float64).to(dtype)  # [s, b, h]
    if case["impl"] in TILED_MLP:
        return x, torch.randn(s, 1, case["hidden"], generator=g, dtype=torch.float64).to(dtype)  # d out
    return x, torch.randint(0, case["vocab"], (1, s), generator=g)  # labels [b, s]


def _tiled_run(impl: str, fn: Callable, x: torch.Tensor, other: Any) -> torch.Tensor:
    """Forward and backward of the MLP (``other`` its output gradient) or of the loss (``other`` the labels)."""
    if impl in TILED_MLP:
        out = fn(x)
        out.backward(other)
    else:
        out = fn(x, other)
        out.backward()
    return out


def _tiled_step(case: dict[str, Any], fn: Callable, params: list[torch.Tensor]) -> tuple[Callable[[], None], list]:
    """(one forward + backward at the measured shape, its leaves)."""
    x, other = _tiled_inputs(case, case["seq"], torch.float32, case["seed"] + 2)
    x.requires_grad_()
    return (lambda: _tiled_run(case["impl"], fn, x, other)), [x, *params]


def tiled_rank(case: dict[str, Any]) -> dict[str, Any]:
    """One tiled MLP / tiled loss case in this process."""
    torch.set_num_threads(1)
    impl = case["impl"]
    # float64 check: the plain untiled computation, then ours/ALST in float32 against it
    fn64, params64 = _tiled_build(case, torch.float64)
    x64, other = _tiled_inputs(case, CHECK_SEQ, torch.float64, case["seed"] + 1)
    x64.requires_grad_()
    if impl in TILED_MLP:
        mlp64 = _SwiGLU(case["hidden"], case["ffn"], torch.float64, case["seed"])
        ref_out = mlp64(x64)
        ref_out.backward(other)
        ref = [ref_out.detach(), x64.grad] + [p.grad for p in mlp64.parameters()]
    else:
        ref_out = F.cross_entropy((x64 @ params64[0].t()).reshape(CHECK_SEQ, -1), other.t().reshape(-1))
        ref_out.backward()
        ref = [ref_out.detach(), x64.grad, params64[0].grad]
    fn, params = _tiled_build(case, torch.float32)
    x = x64.detach().float().requires_grad_()
    out = _tiled_run(impl, fn, x, other.float() if impl in TILED_MLP else other)
    errors = [_max_err(got, r) for got, r in zip([out.detach(), x.grad] + [p.grad for p in params], ref)]
    del fn64, params64, x64, ref, ref_out, x, out
    for p in params:
        p.grad = None
    step, leaves = _tiled_step(case, fn, params)
    gc.collect()
    measured = _measure(step)
    return {**measured, "cpu_s_steps": _steady(step, leaves), "max_rel_err": max(errors)}


# ---------------------------------------------------------------------------------------- interleaved
def interleaved_rank(case: dict[str, Any]) -> dict[str, list[float]]:
    """The implementations ``case["impls"]`` of one shape in this process (pair of gloo ranks for attention):
    one untimed call each, then ``case["rounds"]`` rounds of one timed call each, the order reversed every
    round, so that every implementation meets the same process, allocator and neighbour load.  Returns
    ``{impl: [CPU-seconds of its call in each round]}`` for this rank."""
    torch.set_num_threads(1)
    group = dist.group.WORLD if case["kind"] == "attention" else None
    steps = {}
    for impl in case["impls"]:
        one = {**case, "impl": impl}
        if group is not None:
            steps[impl] = _attention_step(one, *_attention_fn(impl, group))
        else:
            steps[impl] = _tiled_step(one, *_tiled_build(one, torch.float32))
    for impl, (step, leaves) in steps.items():
        _steady(step, leaves, group, calls=1)  # warm-up
    times: dict[str, list[float]] = {impl: [] for impl in steps}
    for r in range(case["rounds"]):
        for impl in (case["impls"] if r % 2 == 0 else case["impls"][::-1]):
            times[impl] += _steady(*steps[impl], group, calls=1)
    return times


# ---------------------------------------------------------------------------------------- torch CP
def torch_cp_rank(case: dict[str, Any]) -> dict[str, Any]:
    """torch's ``context_parallel`` around SDPA on CPU gloo ranks; the error text when it fails."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    q, k, v, dout = _attention_inputs(CHECK_SEQ, case["hq"], case["hq"], case["d"], torch.float32, case["seed"])
    tensors = [x.permute(1, 2, 0, 3).contiguous() for x in (q, k, v, dout)]  # [b, h, s, d]
    ref = _attention_reference(q, k, v, dout)
    import traceback

    failure = None
    try:
        with context_parallel(mesh, buffers=tensors, buffer_seq_dims=[2, 2, 2, 2]):  # shards them in place
            try:
                for x in tensors[:3]:
                    x.requires_grad_()
                out = F.scaled_dot_product_attention(*tensors[:3], is_causal=True)
                out.backward(tensors[3])
            except Exception as exc:  # noqa: BLE001 - reported verbatim: this row says exactly what fails
                failure = exc, traceback.format_exc()[-1500:]
            finally:
                for x in tensors[:3]:
                    x.requires_grad_(False)  # context_parallel resizes its buffers back on exit
    except Exception as exc:  # noqa: BLE001
        failure = failure or (exc, traceback.format_exc()[-1500:])
    if failure is not None:
        text = str(failure[0]).strip().splitlines()
        return {"traceback": failure[1],
                "status": f"fails on CPU: {type(failure[0]).__name__}: {(text[0] if text else '')[:300]}"}
    del ref
    return {"status": "ok (ran; not timed)", "max_rel_err": math.nan}
