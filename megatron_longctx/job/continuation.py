"""Continuing from a checkpoint at a longer length: the source checked before any rank starts.

``megatron-longctx run --load DIR [--finetune] --seq-length L --context-parallel-size C [--rotary-base B]
[--use-rope-scaling --rope-scaling-factor F | --position-embedding-type yarn --rotary-scaling-factor F
--yarn-original-max-position-embeddings N]`` loads a checkpoint written at a shorter length (by the main
job, or by Megatron-LM without the plugin: CP=1, Megatron's own attention; the attention has no weights,
so the state dicts are the same) and continues with the plugin.  Megatron's own loader does the loading;
here, up front:

* :func:`resolve_source`: the iteration to load.  A checkpoint with the main job's manifests is verified
  against them (:mod:`megatron_longctx.job.checkpoint_guard`); one Megatron-LM wrote (no manifest
  anywhere) is taken when its dist-checkpoint metadata is complete;
* :func:`check_architecture`: the checkpoint's saved model shape against the flags (a mismatch would
  otherwise surface as a shape error inside every rank): one line naming the flag and the checkpoint's
  value;
* :func:`check_rope_options`: a RoPE option the installed megatron-core's ``GPTModel`` lacks;
* ``--finetune`` into the directory it loads from is refused (its iterations would be written over).
"""

from __future__ import annotations

import argparse
import inspect
import os
from typing import Any, Optional

from megatron_longctx.job import checkpoint_guard as guard

DIST_METADATA = ".metadata"  # torch_dist's completion marker, written once every rank's shards are saved

# (Megatron arg name, flag) of the settings that decide the parameter shapes and names.
ARCHITECTURE = (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
                ("num_attention_heads", "--num-attention-heads"), ("num_query_groups", "--num-query-groups"),
                ("kv_channels", "--kv-channels"), ("ffn_hidden_size", "--ffn-hidden-size"),
                ("swiglu", "--swiglu"), ("normalization", "--normalization"),
                ("add_bias_linear", "--disable-bias-linear"), ("qk_layernorm", "--qk-layernorm"),
                ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"))


def _reader() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                 "ffn_hidden_size"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    for name in ("swiglu", "qk_layernorm", "untie_embeddings_and_output_weights", "group_query_attention",
                 "finetune", "use_rope_scaling"):
        p.add_argument("--" + name.replace("_", "-"), action="store_true")
    p.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    p.add_argument("--normalization", default="LayerNorm")
    p.add_argument("--position-embedding-type", default="learned_absolute")
    return p


def flags_model(argv: list[str]) -> dict[str, Any]:
    """The architecture the flags ask for, as Megatron would derive it (``kv_channels`` from the heads...)."""
    v, _ = _reader().parse_known_args(argv)
    shape = {name: getattr(v, name) for name, _ in ARCHITECTURE}
    if not v.group_query_attention:
        shape["num_query_groups"] = v.num_attention_heads
    if shape["kv_channels"] is None:
        shape["kv_channels"] = v.hidden_size // v.num_attention_heads
    if shape["ffn_hidden_size"] is None:
        shape["ffn_hidden_size"] = 4 * v.hidden_size
    return shape


def checkpoint_model(args: Any) -> dict[str, Any]:
    """The same settings from the ``args`` namespace Megatron saved with a checkpoint."""
    shape = {name: getattr(args, name, None) for name, _ in ARCHITECTURE}
    if not getattr(args, "group_query_attention", False):
        shape["num_query_groups"] = args.num_attention_heads
    return shape


def _has_manifests(load_dir: str) -> bool:
    return any(os.path.exists(os.path.join(guard.iteration_dir(load_dir, i), guard.MANIFEST))
               for i in guard.saved_iterations(load_dir))


def resolve_source(load_dir: str, step: Optional[int]) -> tuple[int, list[str]]:
    """The iteration to load and notes: the main job's checkpoints verified, Megatron-LM's by its metadata."""
    if not os.path.isdir(load_dir) or _has_manifests(load_dir):
        return guard.resolve_load(load_dir, step)
    if step is None:
        step = guard.tracker_iteration(load_dir)
        if step is None:
            raise guard.CheckpointError(f"--load {load_dir}: no {guard.TRACKER} there, so no complete checkpoint "
                                        "to load; give the iteration with --ckpt-step")
    folder = guard.iteration_dir(load_dir, step)
    if not os.path.exists(os.path.join(folder, DIST_METADATA)):
        raise guard.CheckpointError(f"--load {load_dir}: {folder} has no {DIST_METADATA}, so its save did not "
                                    "finish (or it is not a torch_dist checkpoint); give another --ckpt-step")
    return step, [f"{folder} was written without megatron-longctx (no {guard.MANIFEST}): loading it as Megatron "
                  "wrote it, without checksums"]


def saved_args(folder: str) -> Any:
    """The Megatron ``args`` saved in an iteration folder (its common state dict); ``None`` if absent."""
    import warnings

    from megatron.core import dist_checkpointing

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dist_checkpointing.load_common_state_dict(folder).get("args")


def check_architecture(folder: str, argv: list[str]) -> None:
    """``ValueError`` naming the first flag whose model setting differs from the checkpoint's."""
    args = saved_args(folder)
    if args is None:
        return
    want, have = flags_model(argv), checkpoint_model(args)
    vocab = getattr(args, "padded_vocab_size", None)
    if vocab is not None and vocab != main_job_vocab(argv):
        raise ValueError(f"--load: the checkpoint {folder} has a vocabulary of {vocab} tokens; run, eval and extend "
                         f"train the byte-level corpus ({main_job_vocab(argv)}): continue it with Megatron-LM's "
                         "pretrain_gpt.py under python -m megatron_longctx.launch and its own tokenizer")
    for name, flag in ARCHITECTURE:
        if want[name] != have[name]:
            if isinstance(have[name], bool):
                fix = (f"{'give' if have[name] != (flag == '--disable-bias-linear') else 'drop'} {flag}")
            else:
                fix = f"give {flag} {have[name]}"
            raise ValueError(f"{flag}: the checkpoint {folder} was trained with {name}={have[name]!r}, the flags "
                             f"ask for {want[name]!r}; {fix} to continue from it")


def main_job_vocab(argv: list[str]) -> int:
    """The padded vocabulary the main job's model has (byte tokens, padded as Megatron pads for TP)."""
    from megatron_longctx import data as data_mod

    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    v, _ = p.parse_known_args(argv)
    return data_mod.padded_vocab_size(data_mod.ByteTokenizer(),
                                      v.make_vocab_size_divisible_by * v.tensor_model_parallel_size)


def check_rope_options(argv: list[str]) -> None:
    """``ValueError`` naming a RoPE flag the installed megatron-core's ``GPTModel`` cannot build."""
    v, _ = _reader().parse_known_args(argv)
    if not (v.use_rope_scaling or v.position_embedding_type == "yarn"):
        return
    import importlib.metadata

    from megatron.core.models.gpt import GPTModel

    params = inspect.signature(GPTModel.__init__).parameters
    version = importlib.metadata.version("megatron-core")
    if v.use_rope_scaling and "rope_scaling" not in params:
        raise ValueError(f"--use-rope-scaling: megatron-core {version}'s GPTModel has no rope_scaling; install "
                         "megatron-core >= 0.19 (pip install -c constraints.txt megatron-core) or drop the flag")
    if v.position_embedding_type == "yarn" and "yarn" not in str(params["position_embedding_type"].annotation):
        raise ValueError(f"--position-embedding-type yarn: megatron-core {version}'s GPTModel has no YaRN; "
                         "install megatron-core >= 0.19 or use --use-rope-scaling --rope-scaling-factor")


def check_continuation(load_dir: str, step: int, save: Optional[str], argv: list[str]) -> None:
    """Every up-front check of a run that loads ``load_dir``'s iteration ``step``, saves to ``save``, with the
    Megatron flags ``argv``."""
    v, _ = _reader().parse_known_args(argv)
    if v.finetune and save is not None and os.path.abspath(save) == os.path.abspath(load_dir):
        raise ValueError(f"--finetune with --save {save} equal to --load: the continued run would write its "
                         "iterations over the source checkpoint; give another --save (or --output-dir)")
    check_rope_options(argv)
    check_architecture(guard.iteration_dir(load_dir, step), argv)
