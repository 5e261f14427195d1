"""A small training engine on Megatron-Core for the benchmark: GPTModel, Megatron's DDP and optimizer.

The benchmark measures inside one process, so it drives Megatron-Core directly: ``parallel_state`` for
the groups, ``GPTModel`` from a layer spec (Megatron's local spec, or the same spec through
:func:`megatron_longctx.apply_to_spec`), ``DistributedDataParallel`` (grad reduction over the ``dp_cp``
group), ``get_forward_backward_func()`` (micro-batches) and ``get_megatron_optimizer``, without
checkpoints (the main job, :mod:`megatron_longctx.job.pretrain`, runs Megatron-LM's own training
loop and its checkpoints).  On a CPU-only process everything runs under
:func:`megatron_longctx.megatron.cpu_compat.enabled`.

A variant with ``model_state_offload`` (``host``/``disk``) gets the plugin's model-state streamer over DDP and
its optimizer hooks over Megatron's optimizer (:mod:`megatron_longctx.bench.model_states`); the other memory
features go on the bare model before DDP, as in Megatron's training loop.

There is no substitute path: should Megatron's DDP grad sync or optimizer fail (say a Megatron version
that allocates on ``"cuda"`` somewhere cpu_compat does not know), the step raises that error, so a run
never measures a plain equivalent under Megatron's name.

Loss convention (Megatron's legacy 2-tuple ``loss_func``): each rank returns its masked token-loss sum
divided by the token count of the *whole* micro-batch sequence; Megatron's schedule multiplies by the
CP size and divides by the number of micro-batches, and DDP averages over ``dp_cp``, so the gradient is
the mean over the global batch of each sequence's mean token loss, whatever the DP × CP layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_longctx.bench.memory_meter import MemoryMeter
from megatron_longctx.memory.accounting import rss_bytes
from megatron_longctx.plan.model import ModelShape


@dataclasses.dataclass(frozen=True)
class GPTShape:
    """The GPT being trained: a :class:`~megatron_longctx.plan.model.ModelShape` (the planner's shape type) and
    the run's sequence length, dropout and precision.

    The Trainer builds a dense GPT with RoPE of base 10000, an untied output layer and Megatron's default head
    dimension (hidden / heads); a ``ValueError`` names what else ``model`` asks for.
    """

    model: ModelShape  # layers, widths, heads, vocabulary, activation (swiglu: fc1 is [2·ffn, h]), norm, biases
    seq_length: int = 8192  # --seq-length
    dropout: float = 0.0  # --hidden-dropout and --attention-dropout
    bf16: bool = False  # Megatron's --bf16: bf16 weights and activations; fp32 main grads, master weights, Adam

    def __post_init__(self) -> None:
        m = self.model
        if self.seq_length < 1:
            raise ValueError(f"--seq-length must be >= 1, got {self.seq_length}")
        if m.hidden_size % m.num_attention_heads:
            raise ValueError(f"--hidden-size ({m.hidden_size}) must be a multiple of --num-attention-heads "
                             f"({m.num_attention_heads})")
        if m.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"--normalization {m.normalization!r}: choose LayerNorm or RMSNorm")
        if m.num_experts is not None or m.multi_latent_attention:
            raise ValueError(f"{m.name}: the benchmark's GPT is dense with standard attention; drop --num-experts "
                             "and --multi-latent-attention")
        if not (m.rope and m.rotary_base == 10000 and m.untie_embeddings):
            raise ValueError(f"{m.name}: the benchmark's GPT has RoPE of base 10000 and an untied output layer; set "
                             "rope=True, rotary_base=10000 and untie_embeddings=True")
        if m.kv_channels != m.hidden_size // m.num_attention_heads:
            raise ValueError(f"{m.name}: --kv-channels {m.kv_channels}: the benchmark's GPT uses Megatron's "
                             f"default head dimension, --hidden-size / --num-attention-heads = "
                             f"{m.hidden_size // m.num_attention_heads}")

    def to_dict(self) -> dict[str, Any]:
        """What a probe task carries as its ``shape`` (and ``bench.json`` as ``meta.shape``), JSON-ready: the
        model's fields and the run's ``dropout`` and ``bf16``, without the length that each point sets."""
        return {**dataclasses.asdict(self.model), "dropout": self.dropout, "bf16": self.bf16}

    @classmethod
    def from_dict(cls, record: dict[str, Any], seq_length: int) -> "GPTShape":
        """The shape :meth:`to_dict` wrote, trained at ``seq_length`` tokens."""
        run = {key: record[key] for key in ("dropout", "bf16") if key in record}
        model = ModelShape(**{key: value for key, value in record.items() if key not in run})
        return cls(model, seq_length, **run)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of running the same model: baseline Megatron or the plugin, and its options."""

    name: str
    context_parallel_size: int = 1
    plugin: bool = False
    longctx_options: tuple = ()  # ((field, value), ...) for apply_to_spec / LongContextConfig.from_flat
    megatron_recompute: bool = False
    cp_comm_type: str = "p2p"

    def options(self) -> dict[str, Any]:
        return dict(self.longctx_options)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 0.0
    # Megatron's distributed optimizer (--use-distributed-optimizer): Adam's moments sharded over DP x CP,
    # the gradients reduce-scattered and the updated weights all-gathered; with model-state offload the plugin
    # runs it over the streamed states (ModelStateConfig.distributed_optimizer)
    distributed: bool = False


@dataclasses.dataclass
class StepResult:
    step: int
    loss: float
    grad_norm: float
    step_time_s: float
    tokens: int
    peak_bytes: int
    cpu_time_s: float = 0.0  # process CPU-seconds of the step on this rank (all its threads)


_PREIMPORTED = ("megatron.core.models.gpt", "megatron.core.distributed", "megatron.core.optimizer",
                "megatron.core.pipeline_parallel", "megatron.core.models.gpt.gpt_layer_specs",
                "megatron.core.datasets.gpt_dataset", "megatron_longctx.megatron.spec",
                "megatron_longctx.megatron.core_attention", "megatron_longctx.megatron.plugin",
                "megatron_longctx.kernels.select")


def preimport_megatron(model_states: bool = False) -> None:
    """Import what a run builds before memory is measured, so no measurement pays for module loading
    (``model_states``: also what the model-state rows' optimizer hooks import, Megatron's training loop)."""
    import importlib

    extra = ("megatron.training.training", "megatron_longctx.megatron.features.model_states",
             "megatron_longctx.megatron.offdevice_optimizer") if model_states else ()
    for name in extra + _PREIMPORTED:
        try:
            importlib.import_module(name)
        except ImportError:  # a missing plugin module shows up where it is used, with its reason
            pass


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's wrappers (``ChainedOptimizer``, ``FP32Optimizer`` ...)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if hasattr(optimizer, "chained_optimizers"):
        return [o for inner in optimizer.chained_optimizers for o in _torch_optimizers(inner)]
    inner = getattr(optimizer, "optimizer", None)
    return _torch_optimizers(inner) if inner is not None else []


def materialize_optimizer_state(optimizer: Any) -> None:
    """Create the optimizer's state now rather than in the first step, as it is in every later step.

    torch creates Adam's moments inside the first ``step()``, after that step's forward and backward:
    a one-step measurement would peak without them.  One step with zero gradients, learning rate 0
    and weight decay 0 creates them (zero moments, parameters untouched); its step count is then set
    back to 0, so training proceeds exactly as with lazy creation.
    """
    for opt in _torch_optimizers(optimizer):
        saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in opt.param_groups]
        params = [p for g in opt.param_groups for p in g["params"] if not opt.state.get(p)]
        if not params:
            continue
        for g in opt.param_groups:
            g["lr"] = 0.0
            if "weight_decay" in g:
                g["weight_decay"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        for p in params:
            p.grad = None
            if "step" in opt.state[p]:
                step = opt.state[p]["step"]
                opt.state[p]["step"] = step.zero_() if isinstance(step, torch.Tensor) else 0
        for g, (lr, wd) in zip(opt.param_groups, saved):
            g["lr"] = lr
            if "weight_decay" in g:
                g["weight_decay"] = wd


class Trainer:
    """Model, DDP, optimizer and step of one :class:`Variant`; use inside ``cpu_compat.enabled()``.

    Call on every rank of the default process group.  ``global_batch`` sequences per step are split over
    the data-parallel ranks (world / CP) and then into micro-batches of one sequence.
    """

    def __init__(self, shape: GPTShape, variant: Variant, optim: OptimConfig, global_batch: int, seed: int) -> None:
        from megatron.core import parallel_state

        world = dist.get_world_size()
        cp = variant.context_parallel_size
        if world % cp:
            raise ValueError(f"--context-parallel-size {cp} must divide the number of ranks ({world})")
        if shape.seq_length % (2 * cp):
            raise ValueError(f"--seq-length {shape.seq_length} must be a multiple of 2 x --context-parallel-size "
                             f"({2 * cp}); choose e.g. {shape.seq_length // (2 * cp) * 2 * cp or 2 * cp}")
        self.dp = world // cp
        if global_batch % self.dp:
            raise ValueError(f"--global-batch-size {global_batch} must be a multiple of the data-parallel size "
                             f"({self.dp} = {world} ranks / CP {cp})")
        self.shape, self.variant, self.optim_cfg, self.seed = shape, variant, optim, seed
        self.global_batch, self.num_microbatches = global_batch, global_batch // self.dp
        parallel_state.initialize_model_parallel(context_parallel_size=cp)
        try:
            self.cp_group = parallel_state.get_context_parallel_group()
            self.dp_rank = parallel_state.get_data_parallel_rank()
            self._reseed(0)
            self.config = self._transformer_config()
            self.model = self._build_model()  # the GPTModel (inside Float16Module under bf16)
            self.plugin = self._make_plugin()
            streamed = self.plugin is not None and self.plugin.cfg.model_states.enabled
            self.megatron_distributed = optim.distributed and not streamed  # else the plugin runs it
            self.memory_handle = self._install_memory()
            self.ddp = self._wrap_ddp()
            self.model_states = self._install_model_states()
            self.optimizer = self._build_optimizer()
            if self.model_states is not None:
                self.model_states.wire_optimizer(self.optimizer)
            if not (self.model_states is not None and self.model_states.target == "disk"):
                materialize_optimizer_state(self.optimizer)  # disk: the moments are in a file from the first step
        except BaseException:  # a refused configuration leaves the process as it found it
            self._remove_memory()
            parallel_state.destroy_model_parallel()
            raise

    # ------------------------------------------------------------------ construction
    def _transformer_config(self) -> Any:
        from megatron.core.transformer import TransformerConfig

        s, m, v = self.shape, self.shape.model, self.variant
        extra: dict[str, Any] = {}
        if v.megatron_recompute:
            extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if v.context_parallel_size > 1:
            extra["cp_comm_type"] = v.cp_comm_type
        if m.activation == "swiglu":  # Llama's MLP: silu(x W_gate) * (x W_up), one fused fc1 of 2·ffn rows
            extra.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
        return TransformerConfig(
            normalization=m.normalization, add_bias_linear=m.add_bias_linear,
            num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size,
            hidden_dropout=s.dropout, attention_dropout=s.dropout, context_parallel_size=v.context_parallel_size,
            use_cpu_initialization=True, params_dtype=torch.bfloat16 if s.bf16 else torch.float32, bf16=s.bf16,
            **extra,
        )

    def layer_spec(self) -> Any:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        spec = get_gpt_layer_local_spec(normalization=self.shape.model.normalization)
        if self.variant.plugin:
            from megatron_longctx.config import LongContextConfig
            from megatron_longctx.megatron.plugin import LongContextPlugin

            spec = LongContextPlugin(LongContextConfig.from_flat(self.variant.options())).spec(spec)
        elif self.variant.context_parallel_size > 1:
            raise ValueError("baseline Megatron's local attention refuses CP > 1 without Transformer Engine; "
                             "run the baseline with --context-parallel-size 1")
        return spec

    def _build_model(self) -> torch.nn.Module:
        from megatron.core.models.gpt import GPTModel

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = GPTModel(self.config, self.layer_spec(), vocab_size=self.shape.model.vocab_size,
                             max_sequence_length=self.shape.seq_length, position_embedding_type="rope")
        return model.to(device())

    def _make_plugin(self) -> Any:
        """The plugin object of this variant (None for baseline Megatron), the one both installs use."""
        if not self.variant.plugin:
            return None
        from megatron_longctx.config import LongContextConfig
        from megatron_longctx.megatron.plugin import LongContextPlugin

        options = self.variant.options()
        if self.optim_cfg.distributed and options.get("model_state_offload", "none") != "none":
            options["distributed_optimizer"] = True  # the plugin shards its off-device optimizer
        return LongContextPlugin(LongContextConfig.from_flat(options))

    def _install_memory(self) -> Any:
        plugin = self.plugin
        if plugin is None or not plugin.cfg.memory.any_enabled:
            return None
        # the model states go on after DDP (_install_model_states)
        return plugin.install(self.model, tuple(f for f in plugin.features if not f.waits_for_optimizer))

    def _install_model_states(self) -> Any:
        """``--longctx-model-state-offload``: the plugin's own installer over the DDP-wrapped model."""
        plugin = self.plugin
        if plugin is None or not plugin.cfg.model_states.enabled:
            return None
        from megatron_longctx.bench.model_states import ModelStates

        return ModelStates.install(self.ddp, plugin)

    def _wrap_ddp(self) -> Any:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

        module = self.model
        if self.shape.bf16:  # as Megatron's get_model: casts the inputs, and the outputs back to float32
            from megatron.core.transformer.module import Float16Module

            module = Float16Module(self.config, self.model)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   use_distributed_optimizer=self.megatron_distributed)
        with self.plugin.wrapping_ddp(self.model) if self.plugin is not None else contextlib.nullcontext():
            ddp = DistributedDataParallel(self.config, ddp_config, module)
        self.config.no_sync_func = ddp.no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        return ddp

    def _build_optimizer(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        o = self.optim_cfg
        cfg = OptimizerConfig(optimizer="adam", lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                              adam_beta2=o.adam_beta2, clip_grad=o.clip_grad, bf16=self.shape.bf16,
                              fp16=False, use_distributed_optimizer=self.megatron_distributed)
        building = self.model_states.building_optimizer() if self.model_states is not None else contextlib.nullcontext()
        with building:
            return get_megatron_optimizer(cfg, [self.ddp])

    # ------------------------------------------------------------------ one step
    def _reseed(self, step: int) -> None:
        """Seeds are a function of (seed, step): a resumed run draws what the uninterrupted run drew."""
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        torch.manual_seed(self.seed + step)
        model_parallel_cuda_manual_seed(self.seed + step)

    def _microbatches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches: its DP share of ``batch`` ``[gbs, s]``, one sequence each, CP-sliced."""
        from megatron_longctx.megatron.batch import get_batch_on_this_cp_rank

        out = []
        for m in range(self.num_microbatches):
            row = self.dp_rank * self.num_microbatches + m
            micro = {k: v[row:row + 1].to(device()) for k, v in batch.items()}  # [1, s]
            total = micro["loss_mask"].sum()
            local = get_batch_on_this_cp_rank(micro, self.cp_group)  # [1, s/cp]
            local["total_tokens"] = total
            out.append(local)
        return out

    def _forward_step(self, data_iterator: Any, model: Any) -> tuple:
        mb = next(data_iterator)
        per_token = model(mb["tokens"], mb["position_ids"], None, labels=mb["labels"])  # [1, s/cp]

        def loss_func(output: torch.Tensor) -> tuple:
            local = (output.float() * mb["loss_mask"]).sum() / mb["total_tokens"].clamp(min=1)
            return local, {"loss": local.detach().clone()}

        return per_token, loss_func

    def step(self, step: int, batch: dict[str, torch.Tensor] | Callable[[], dict[str, torch.Tensor]],
             meter: Optional[MemoryMeter] = None) -> StepResult:
        """One optimizer step on ``batch``: the global batch ``[gbs, s]``, identical on every rank, or a function
        that makes it, whose batch then lives only until this rank's micro-batches (its CP slices) are cut from
        it, as Megatron's ``get_batch`` keeps only those."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self._reseed(step)
        micro = self._microbatches(batch() if callable(batch) else batch)
        _sync()
        start, cpu_start = time.perf_counter(), time.process_time()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=self._forward_step, data_iterator=iter(micro), model=[self.ddp],
            num_microbatches=self.num_microbatches, seq_length=self.shape.seq_length, micro_batch_size=1,
            forward_only=False,
        )
        grad_norm = self._optimizer_step()
        _sync()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        loss = torch.stack([d["loss"] for d in losses]).sum() / self.num_microbatches  # this rank's CP share
        dist.all_reduce(loss)  # sum over CP shares and DP ranks
        tokens = self.global_batch * self.shape.seq_length
        return StepResult(step=step, loss=loss.item() / self.dp, grad_norm=float(grad_norm), step_time_s=elapsed,
                          tokens=tokens, peak_bytes=meter.peak_bytes if meter else 0, cpu_time_s=cpu)

    def _optimizer_step(self) -> float:
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError("the optimizer step was skipped (non-finite gradients)")
        return float(grad_norm if grad_norm is not None else math.nan)

    def parameter_checksum(self) -> float:
        """Sum of |w| over this rank's parameters (equal inits across layouts give equal sums)."""
        return float(sum(p.detach().double().abs().sum() for p in self.model.parameters()))

    def _remove_memory(self) -> None:
        states, self.model_states = getattr(self, "model_states", None), None
        if states is not None:
            states.close()
        handle, self.memory_handle = getattr(self, "memory_handle", None), None
        if handle is not None and hasattr(handle, "remove"):
            handle.remove()

    def close(self) -> None:
        from megatron.core import parallel_state

        self._remove_memory()
        parallel_state.destroy_model_parallel()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def run_steps(trainer: Trainer, batches: Callable[[int], dict], start: int, stop: int,
              on_step: Optional[Callable[[StepResult], None]] = None, budget_bytes: Optional[int] = None,
              base_bytes: Optional[int] = None) -> list[StepResult]:
    """Steps ``start .. stop-1`` (``batches(step)`` gives each global batch), measuring peak memory."""
    results = []
    base = rss_bytes() if base_bytes is None else base_bytes
    for step in range(start, stop):
        with MemoryMeter(device(), base, budget_bytes) as meter:
            result = trainer.step(step, functools.partial(batches, step), meter)
        result.peak_bytes = meter.peak_bytes
        results.append(result)
        if on_step is not None:
            on_step(result)
    return results
