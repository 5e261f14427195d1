"""Model-state offload's checks before any process group starts: Megatron's own weight offload, the disk
directory, the host pool's bound against two layer slots (each error names the flags and the fix)."""

from __future__ import annotations

import errno
import os

from megatron_longctx.memory.model_states import FLAG

MEGATRON_CPU_OFFLOAD = ("cpu_offloading", "cpu_offloading_num_layers", "cpu_offloading_weights")


def check_megatron_offload(values: dict, fix_prefix: str = "--") -> None:
    """Refuse Megatron's own ``cpu_offloading*`` together with model-state offload (``values``: Megatron's
    arguments or Bridge's model config fields)."""
    given = _given(MEGATRON_CPU_OFFLOAD, values, fix_prefix)
    if given:
        raise ValueError(f"{FLAG}: Megatron's {given} would move the same layers' weights as well; drop {given} "
                         f"(megatron-longctx's --longctx-offload-policy offloads activations), or drop {FLAG}")


def _given(names: tuple, values: dict, fix_prefix: str) -> str:
    """The flags (``--x-y``) or fields (``prefix + x_y``) among ``names`` that ``values`` turns on, joined."""
    on = [n for n in names if values.get(n)]
    return ", ".join(fix_prefix + n.replace("_", "-") if fix_prefix == "--" else fix_prefix + n for n in on)


# Megatron's DDP flags whose work the streamer does per unit itself (its reduction as each unit's backward ends)
DDP_OVERLAP = ("overlap_grad_reduce", "overlap_param_gather", "ddp_average_in_collective")


def check_ddp_overlap(values: dict, fix_prefix: str = "--") -> None:
    """Refuse Megatron's overlapped gradient reduction and parameter gather beside model-state offload: the
    streamer sums each unit's gradients as its backward ends, and gathers the updated weights after the step."""
    given = _given(DDP_OVERLAP, values, fix_prefix)
    if given:
        raise ValueError(f"{FLAG}: the streamer reduces each layer's gradients as its backward ends and gathers the "
                         f"updated weights after the step; drop {given}")


def check_disk_step(values: dict) -> None:
    """What the ``disk`` target's unit-by-unit optimizer step serves: float32 parameters, or bf16 ones with
    their float32 masters on disk and no loss scaling (fp16's, or ``--loss-scale``, would check and unscale
    every gradient at once), and no zero counting over all gradients."""
    if values.get("fp16"):
        raise ValueError(f"{FLAG} disk steps float32 or bf16 parameters unit by unit; --fp16's loss scaling "
                         f"checks every gradient at once: use --bf16, or {FLAG} host")
    if values.get("bf16") and values.get("loss_scale"):
        raise ValueError(f"{FLAG} disk: --loss-scale under --bf16 would unscale every gradient at once; drop "
                         f"--loss-scale, or use {FLAG} host")
    if values.get("data_parallel_random_init"):
        raise ValueError(f"{FLAG} disk: --data-parallel-random-init broadcasts every weight after the build, and "
                         "each layer's weights are in their file by then; drop --data-parallel-random-init or use "
                         f"{FLAG} host")
    if values.get("log_num_zeros_in_grad"):
        raise ValueError(f"{FLAG} disk: --log-num-zeros-in-grad would count zeros over every gradient at once; "
                         "drop --log-num-zeros-in-grad")


def check_disk_dir(root: str) -> None:
    """The directory the model states' files go under can be created and written."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".probe-{os.getpid()}")
        with open(probe, "wb") as fh:
            fh.write(b"\0")
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"{FLAG} disk: --longctx-offload-disk-dir {root} is not writable "
                         f"({errno.errorcode.get(exc.errno or 0, 'EIO')}: {exc.strerror}); give a directory this user "
                         "can write") from exc


def layer_params(hidden: int, ffn: int, heads: int, groups: int, gated: bool = True) -> int:
    """Parameters of one GPT transformer layer (attention with ``groups`` key/value heads, an MLP that is
    SwiGLU-gated or not, two norms; no biases)."""
    head_dim = hidden // heads
    attention = hidden * (hidden + 2 * groups * head_dim) + hidden * hidden
    mlp = hidden * ffn * (3 if gated else 2)
    return attention + mlp + 2 * hidden


def check_pool_holds_slots(pool_bytes: int, unit_params: int, weight_bytes: int = 2) -> None:
    """The host pool holds at least two layers' weights and fp32 main gradients (what the slots move)."""
    need = 2 * unit_params * (weight_bytes + 4)
    if pool_bytes < need:
        raise ValueError(f"{FLAG}: --longctx-offload-host-pool-bytes {pool_bytes} cannot hold two layer slots "
                         f"({need} bytes: 2 x {unit_params} parameters x ({weight_bytes} + 4) bytes); raise it to "
                         f"at least {need}")
