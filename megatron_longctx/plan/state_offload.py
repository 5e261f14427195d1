"""Model-state offload (``--longctx-model-state-offload host|disk``) from what it moves: bytes and times.

:func:`state_offload` gives the :class:`StateOffload` of one GPU of one pipeline stage: host and NVMe bytes
by part (:meth:`~StateOffload.host_parts`, :meth:`~StateOffload.disk_parts`), one layer's copies against the
compute they hide behind (:meth:`~StateOffload.layer_copies`, :class:`LayerCopies`) and the optimizer step
on the CPU (:meth:`~StateOffload.optimizer_step_s`).  Per layer and micro-batch a layer's bf16 weights come
in twice (forward, recompute/backward) and its main gradients go out once; each copy hides behind the
compute of the layer before it, and ``disk`` is bounded by the slower of NVMe and PCIe.
What the feature does, what moves where and the timing model: docs/model-state-offload.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .model import MASTER_BYTES, MOMENT_BYTES, WEIGHT_BYTES, MemoryOptions, ModelShape, Parallel, param_counts
from .states import stage_params

Hardware = Any  # .timing.Hardware (timing builds on this module): host_gbps, link_efficiency, nvme_gbps



def disk_step_bytes_per_param(grad_bytes: int, optimizer_shards: int = 1) -> float:
    """NVMe bytes one ``disk`` optimizer step moves per parameter: the gradients read twice (the norm, then
    the moments), the moments (this rank's share of them) read, written and read back, the masters read and
    written, and the bf16 weights written (rounded from the masters, so never read)."""
    return 2 * grad_bytes + 3 * MOMENT_BYTES / optimizer_shards + 2 * MASTER_BYTES + WEIGHT_BYTES

# The off-device AdamW's staging (memory.offdevice_optimizer): 4M-element fp32 chunks; the denominator, and
# the two moments read from disk.
OPTIMIZER_CHUNK_BYTES = 4 * (1 << 22)
OPTIMIZER_STAGING_CHUNKS = {"host": 1, "disk": 3}
HOST_ADAM_PARAMS_PER_S = 1e9  # CPU AdamW throughput available to one GPU's parameters


@dataclasses.dataclass(frozen=True)
class StateOffload:
    """Bytes model-state offload keeps off the GPU and moves, for one GPU of one pipeline stage."""

    target: str  # "host" or "disk"
    layers: int  # transformer layers on the stage
    layer_params: float  # one transformer layer's parameters on this GPU (TP-sharded)
    total_params: float  # all the stage's parameters on this GPU (layers, embeddings, norms)
    largest_unit: float  # the largest streamed block (a layer or an embedding matrix)
    grad_bytes: int  # bytes of a main gradient element (4 fp32, 2 bf16)
    # ranks Adam's moments are sharded over (Megatron's --use-distributed-optimizer, which the plugin runs over
    # the streamed states: data x context parallel); the fp32 masters stay whole on each rank
    optimizer_shards: int = 1

    @property
    def weights_in(self) -> float:
        """Bytes of one layer's bf16 weights, streamed in once for the forward and once for the backward."""
        return WEIGHT_BYTES * self.layer_params

    @property
    def grads_out(self) -> float:
        """Bytes of one layer's main gradients streamed out per micro-batch."""
        return self.grad_bytes * self.layer_params

    @property
    def other_params(self) -> float:
        """Embedding, output layer and final norm: streamed as their own blocks."""
        return self.total_params - self.layers * self.layer_params

    def host_parts(self) -> dict[str, float]:
        """Host bytes by part."""
        p, unit = self.total_params, self.largest_unit
        if self.target == "host":
            return {"bf16 weights": WEIGHT_BYTES * p, "fp32 master weights": MASTER_BYTES * p,
                    "Adam moments": MOMENT_BYTES * p / self.optimizer_shards,
                    "main grads (accumulated)": self.grad_bytes * p}
        # disk: the pinned buffers one unit's states pass through on their way to and from NVMe
        return {"one unit's staging": max(WEIGHT_BYTES, self.grad_bytes) * unit,
                "next unit's weights (read-ahead)": WEIGHT_BYTES * unit,
                "one unit's fp32 masters": MASTER_BYTES * unit}

    def disk_parts(self) -> dict[str, float]:
        """NVMe bytes by part (``disk``)."""
        if self.target != "disk":
            return {}
        p = self.total_params
        return {"bf16 weights": WEIGHT_BYTES * p, "fp32 master weights": MASTER_BYTES * p,
                "main grads (accumulated)": self.grad_bytes * p, "Adam moments": MOMENT_BYTES * p / self.optimizer_shards,
                "moments being written (step)": MOMENT_BYTES * p / self.optimizer_shards}

    @property
    def pinned(self) -> float:
        """Host bytes in the pinned pool (the bound activations share): what the copies read and write (bf16
        weights and main grads, or ``disk``'s staging buffers) and the optimizer's staging chunks."""
        parts = self.host_parts()
        chunks = OPTIMIZER_STAGING_CHUNKS[self.target] * OPTIMIZER_CHUNK_BYTES
        if self.target == "host":
            return parts["bf16 weights"] + parts["main grads (accumulated)"] + chunks
        return sum(parts.values()) + chunks

    @property
    def host(self) -> float:
        return sum(self.host_parts().values())

    @property
    def disk(self) -> float:
        return sum(self.disk_parts().values())

    def in_bytes_per_s(self, hw: Hardware) -> float:
        """Rate of the weights' way in: PCIe from pinned memory, and for ``disk`` NVMe before it."""
        pcie = hw.host_gbps * 1e9 * hw.link_efficiency
        return min(pcie, hw.nvme_gbps * 1e9) if self.target == "disk" else pcie

    def layer_copies(self, hw: Hardware, fwd_layer_s: float, replay: bool) -> "LayerCopies":
        """One layer's copy and compute times per micro-batch."""
        rate = self.in_bytes_per_s(hw)  # the same bound on the gradients' way out to NVMe (disk)
        return LayerCopies(weights_in_s=self.weights_in / rate, grads_out_s=self.grads_out / rate,
                           forward_s=fwd_layer_s, backward_s=(3 if replay else 2) * fwd_layer_s)

    def other_copies_s(self, hw: Hardware) -> float:
        """The embedding's and output layer's copies per micro-batch (in twice, gradients out), not hidden."""
        rate = self.in_bytes_per_s(hw)
        return (2 * WEIGHT_BYTES * self.other_params + self.grad_bytes * self.other_params) / rate

    def optimizer_step_s(self, hw: Hardware) -> float:
        """Once a step: the CPU AdamW over this rank's share, for ``disk`` its NVMe traffic
        (:func:`disk_step_bytes_per_param`), and with sharded moments the all-gather of the updated weights
        (every unit through the GPU and back; for ``disk`` its file read and written again)."""
        cpu = self.total_params / self.optimizer_shards / HOST_ADAM_PARAMS_PER_S
        gather = 0.0
        if self.optimizer_shards > 1:
            gather = 2 * WEIGHT_BYTES * self.total_params / (hw.host_gbps * 1e9 * hw.link_efficiency)
            if self.target == "disk":
                gather += 2 * WEIGHT_BYTES * self.total_params / (hw.nvme_gbps * 1e9)
        if self.target != "disk":
            return cpu + gather
        nvme = disk_step_bytes_per_param(self.grad_bytes, self.optimizer_shards) * self.total_params
        return cpu + gather + nvme / (hw.nvme_gbps * 1e9)


@dataclasses.dataclass(frozen=True)
class LayerCopies:
    """One layer per micro-batch: its copies and the compute they hide behind."""

    weights_in_s: float  # one pass of the layer's weights in (twice per micro-batch)
    grads_out_s: float  # its gradients out (during the backward, the other direction)
    forward_s: float  # the compute the forward's copy hides behind
    backward_s: float  # the recompute + backward the backward's copies hide behind

    @property
    def exposed_s(self) -> float:
        return (max(0.0, self.weights_in_s - self.forward_s)
                + max(0.0, max(self.weights_in_s, self.grads_out_s) - self.backward_s))

    @property
    def copy_s(self) -> float:
        return 2 * self.weights_in_s + self.grads_out_s

    @property
    def hidden(self) -> bool:
        return self.exposed_s == 0.0


def state_offload(m: ModelShape, par: Parallel, opt: MemoryOptions, stage: str = "first") -> StateOffload | None:
    """The model-state offload of one GPU of ``stage`` (None when it is off)."""
    if not opt.model_state_offload:
        return None
    sp = stage_params(m, par, stage)
    pc = param_counts(m)
    per_layer = (pc.attention + (pc.dense_mlp if m.num_experts is None else pc.moe_routed / par.ep)) / par.tp
    per_layer += pc.norms
    return StateOffload(opt.model_state_offload, sp.layers, per_layer, sp.total, sp.largest_unit,
                        4 if opt.main_grads_dtype == "fp32" else 2, optimizer_shards=par.dp * par.cp)
