"""The main job's Megatron-LM command lines: its defaults, the user's flags on top, checked up front.

:data:`DEFAULTS` is today's main job in Megatron-LM's own flags (a small GPT, 8K tokens, CP=2, fp32,
Megatron's local layers, no fused kernels, the stdlib corpus); whatever the user passes comes after
it, so it wins.  The flags whose values the launcher needs (shape, parallel sizes, steps, checkpoints,
timeouts) are read here and checked before any rank starts: a zero or negative size, a CP size that
does not divide the ranks, a sequence CP cannot split, dropout under the plugin's CP, each raise
``ValueError`` naming the flag.  ``--save``/``--load``/``--ckpt-step``/``--save-interval`` are taken
out of the user's flags and given to each phase as it needs them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Optional

from megatron_longctx.megatron.arguments import check_window

CPU_TIMEOUT_MINUTES = 2  # rendezvous, dataset index build and the first step
CPU_TIMEOUT_AFTER_INIT_S = 60  # any later collective: a stuck rank fails the job within this

DEFAULTS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--group-query-attention",
    "--num-query-groups", "1", "--ffn-hidden-size", "256", "--seq-length", "8192", "--max-position-embeddings",
    "8192", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "24", "--lr", "2e-3",
    "--min-lr", "2e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.01",
    "--clip-grad", "0", "--seed", "1234", "--context-parallel-size", "2", "--cp-comm-type", "p2p",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--position-embedding-type", "rope",
    "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
    "--no-rope-fusion", "--no-create-attention-mask-in-dataloader", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "257", "--make-vocab-size-divisible-by", "64", "--split", "100,0,0", "--num-workers", "0",
    "--eval-iters", "0", "--eval-interval", "1000000", "--log-interval", "1000000",
]

# (flag, type, minimum) of the numeric Megatron flags the launcher reads; None: not given, Megatron decides.
_NUMERIC = (
    ("--num-layers", int, 1), ("--hidden-size", int, 1), ("--num-attention-heads", int, 1),
    ("--num-query-groups", int, 1), ("--kv-channels", int, 1), ("--ffn-hidden-size", int, 1),
    ("--seq-length", int, 1), ("--max-position-embeddings", int, 1), ("--micro-batch-size", int, 1),
    ("--global-batch-size", int, 1), ("--train-iters", int, 1), ("--context-parallel-size", int, 1),
    ("--tensor-model-parallel-size", int, 1), ("--pipeline-model-parallel-size", int, 1),
    ("--save-interval", int, 1), ("--ckpt-step", int, 0), ("--distributed-timeout-minutes", int, 1),
    ("--distributed-timeout-seconds-after-init", int, 1), ("--lr", float, 0.0), ("--log-interval", int, 1),
    ("--attention-dropout", float, 0.0), ("--hidden-dropout", float, 0.0), ("--lr-warmup-iters", int, 0),
    ("--lr-decay-iters", int, 1), ("--min-lr", float, 0.0),
)
_MANAGED = ("--save", "--load", "--ckpt-step", "--save-interval", "--exit-interval")
_OWN_MINIMUM = (("nproc_per_node", 1), ("data_max_bytes", 1), ("data_passkeys", 0), ("resume_check_steps", 1),
                ("baseline_steps", 1))


def job_parser(prog: str, doc: str, epilog: str, group: str, output_dir: str,
               output_help: str) -> tuple[argparse.ArgumentParser, Any]:
    """The parser of a command that starts ranks on the byte corpus (``run``, ``eval``), and its own group
    holding what they share: ranks, output folder, corpus."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, epilog=epilog)
    g = p.add_argument_group(group)
    g.add_argument("--nproc-per-node", type=int, default=2, help="ranks to start")
    g.add_argument("--output-dir", default=output_dir, help=output_help)
    g.add_argument("--data-dir", default=None, help="indexed dataset cache (default: OUTPUT_DIR/../data)")
    g.add_argument("--data-max-bytes", type=int, default=4 << 20, help="bytes of stdlib sources in the corpus")
    g.add_argument("--data-passkeys", type=int, default=0, metavar="COUNT",
                   help="add COUNT passkey prompts to the corpus, each a document of its own (eval's format; lengths "
                        "up to --seq-length, needles at every depth): what a model learns passkey retrieval from")
    return p, g


def _reader() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag, kind, _ in _NUMERIC:
        p.add_argument(flag, type=kind, default=None)
    for flag in ("--save", "--load", "--exit-interval", "--train-samples", "--cp-comm-type", "--window-size"):
        p.add_argument(flag, default=None, nargs="+" if flag == "--cp-comm-type" else None)
    p.add_argument("--group-query-attention", action="store_true")
    p.add_argument("--finetune", action="store_true")
    p.set_defaults(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)  # Megatron's defaults
    return p


def _strip(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without ``flags`` and their values (``--flag V`` and ``--flag=V``)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in flags:
            skip = "=" not in item
            continue
        out.append(item)
    return out


def _check_numbers(values: argparse.Namespace, own: argparse.Namespace) -> None:
    for flag, _, minimum in _NUMERIC:
        value = getattr(values, flag[2:].replace("-", "_"))
        if value is not None and value < minimum:
            raise ValueError(f"{flag} {value}: must be >= {minimum}")
    for dest, minimum in _OWN_MINIMUM:
        if getattr(own, dest) < minimum:
            raise ValueError(f"--{dest.replace('_', '-')} {getattr(own, dest)}: must be >= {minimum}")
    for flag in ("--attention-dropout", "--hidden-dropout"):
        value = getattr(values, flag[2:].replace("-", "_"))
        if value >= 1.0:
            raise ValueError(f"{flag} {value}: a dropout probability must be in [0, 1)")
    if values.train_samples is not None:
        raise ValueError("--train-samples: the main job counts steps; give --train-iters instead")
    if values.min_lr > values.lr:
        raise ValueError(f"--lr {values.lr} is below --min-lr {values.min_lr} (the main job's default is 2e-4); "
                         f"give --min-lr {values.lr / 10:g} or lower")
    decay = values.lr_decay_iters or values.train_iters  # Megatron decays over --train-iters by default
    if values.lr_warmup_iters >= decay:
        over = f"--lr-decay-iters {decay}" if values.lr_decay_iters else f"--train-iters {decay}"
        raise ValueError(f"--lr-warmup-iters {values.lr_warmup_iters} must be below {over} (Megatron decays the "
                         f"learning rate after the warm-up); give e.g. --lr-warmup-iters {max(0, decay - 1)}")


def _check_layout(v: argparse.Namespace, world: int) -> None:
    if v.kv_channels is None and v.hidden_size % v.num_attention_heads:
        raise ValueError(f"--hidden-size {v.hidden_size} must be a multiple of --num-attention-heads "
                         f"{v.num_attention_heads} (or give the head dim with --kv-channels)")
    if v.group_query_attention and v.num_attention_heads % v.num_query_groups:
        raise ValueError(f"--num-attention-heads {v.num_attention_heads} must be a multiple of --num-query-groups "
                         f"{v.num_query_groups}")
    model_parallel = v.context_parallel_size * v.tensor_model_parallel_size * v.pipeline_model_parallel_size
    if world % model_parallel:
        raise ValueError(f"--context-parallel-size {v.context_parallel_size} x --tensor-model-parallel-size "
                         f"{v.tensor_model_parallel_size} x --pipeline-model-parallel-size "
                         f"{v.pipeline_model_parallel_size} must divide the {world} ranks (--nproc-per-node)")
    check_window(v.window_size, v.seq_length)
    cp = v.context_parallel_size
    if cp > 1 and v.seq_length % (2 * cp):
        raise ValueError(f"--seq-length {v.seq_length} must be a multiple of 2 x --context-parallel-size "
                         f"({2 * cp}); choose e.g. {max(1, v.seq_length // (2 * cp)) * 2 * cp}")
    dp = world // model_parallel
    if v.global_batch_size % (v.micro_batch_size * dp):
        raise ValueError(f"--global-batch-size {v.global_batch_size} must be a multiple of --micro-batch-size "
                         f"{v.micro_batch_size} x the data-parallel size {dp} ({world} ranks / CP {cp})")
    if cp > 1 and v.attention_dropout > 0:
        raise ValueError(f"--attention-dropout {v.attention_dropout}: the plugin's context-parallel attention has "
                         f"no dropout across CP ranks (--context-parallel-size {cp}); set --attention-dropout 0")


@dataclasses.dataclass
class Job:
    """The user's Megatron flags, what the launcher read from them, and each phase's command line."""

    user_argv: list[str]
    values: argparse.Namespace
    save: Optional[str]
    load: Optional[str]
    ckpt_step: Optional[int]
    save_interval: int
    own: argparse.Namespace
    load_step: Optional[int] = None
    data_path: str = ""

    @classmethod
    def from_argv(cls, megatron_argv: list[str], own: argparse.Namespace) -> "Job":
        check_flags(megatron_argv)
        values, _ = _reader().parse_known_args(DEFAULTS + megatron_argv)
        given = {item.split("=", 1)[0] for item in megatron_argv}
        if "--lr-warmup-iters" not in given and values.lr_decay_iters is None and values.train_iters is not None \
                and 1 <= values.train_iters <= values.lr_warmup_iters:  # a short run: the default warm-up fits it
            values.lr_warmup_iters = values.train_iters - 1
            megatron_argv = [*megatron_argv, "--lr-warmup-iters", str(values.lr_warmup_iters)]
        _check_numbers(values, own)
        _check_layout(values, own.nproc_per_node)
        save = values.save if values.save is not None else os.path.join(own.output_dir, "checkpoint")
        interval = values.save_interval or max(1, values.train_iters // 2)
        if values.exit_interval is not None:
            raise ValueError("--exit-interval: the main job stops at --train-iters; lower --train-iters instead")
        return cls(user_argv=_strip(megatron_argv, _MANAGED), values=values, save=save, load=values.load,
                   ckpt_step=values.ckpt_step, save_interval=interval, own=own)

    # ---------------------------------------------------------------------------------- values
    @property
    def train_iters(self) -> int:
        return self.values.train_iters

    @property
    def global_batch_size(self) -> int:
        return self.values.global_batch_size

    @property
    def context_parallel_size(self) -> int:
        return self.values.context_parallel_size

    def shape(self) -> dict[str, Any]:
        v = self.values
        return {"num_layers": v.num_layers, "hidden_size": v.hidden_size, "num_attention_heads": v.num_attention_heads,
                "num_query_groups": v.num_query_groups if v.group_query_attention else v.num_attention_heads,
                "ffn_hidden_size": v.ffn_hidden_size, "seq_length": v.seq_length}

    def longctx_flags(self) -> list[str]:
        return [a for a in self.user_argv if a.startswith("--longctx-")]

    # ---------------------------------------------------------------------------------- phases
    def _common(self) -> list[str]:
        return [*DEFAULTS, *_platform_defaults(self.own), "--data-path", self.data_path, *self.user_argv]

    def plugin_argv(self) -> list[str]:
        argv = [*self._common(), "--save", self.save, "--save-interval", str(self.save_interval)]
        if self.load is not None:
            argv += ["--load", self.load, "--ckpt-step", str(self.load_step)]
        return argv

    def resume_point(self, steps: int) -> Optional[int]:
        """The newest iteration this run saved that leaves ``steps`` steps to compare (``None``: none)."""
        from megatron_longctx.job.checkpoint_guard import saved_iterations

        first = 0 if self.values.finetune else (self.load_step or 0)  # --finetune starts at iteration 0
        points = [i for i in saved_iterations(self.save) if first < i <= self.train_iters - steps]
        return points[-1] if points else None

    def resume_argv(self, step: int, stop: int) -> list[str]:
        """A fresh job from ``--save``'s iteration ``step`` to ``stop`` (same schedule, no checkpoint written)."""
        return [*self._common(), "--load", self.save, "--ckpt-step", str(step), "--exit-interval", str(stop)]

    def baseline_argv(self, steps: int) -> list[str]:
        argv = [*self._common(), "--context-parallel-size", "1"]
        if self.load is not None:  # the comparison starts from the same checkpoint
            argv += ["--load", self.load, "--ckpt-step", str(self.load_step)]
        return argv + (["--exit-interval", str(steps)] if steps < self.train_iters else [])


class _Refused(Exception):
    pass


def check_flags(megatron_argv: list[str]) -> None:
    """Parse the command line with Megatron's own parser and the plugin's flags, as every rank will, and
    check it as the launcher does, before any rank starts: ``ValueError`` naming the flag and the choices."""
    from megatron.training.arguments import add_megatron_arguments

    from megatron_longctx.cp_algorithms import BY_CP_COMM_TYPE
    from megatron_longctx.megatron.arguments import add_longctx_args, check_after_parsing, config_from_args

    parser = argparse.ArgumentParser(allow_abbrev=False)

    def error(message: str) -> None:
        raise _Refused(message)

    parser.error = error  # type: ignore[method-assign]  # our parser: the message becomes the one error line
    add_longctx_args(add_megatron_arguments(parser))
    try:
        args, _ = parser.parse_known_args(DEFAULTS + megatron_argv)
    except _Refused as err:
        raise ValueError(str(err)) from None
    comm = args.cp_comm_type if isinstance(args.cp_comm_type, list) else [args.cp_comm_type]
    bad = [c for c in comm if c is not None and c not in BY_CP_COMM_TYPE]
    if bad and config_from_args(args).cp.cp_algorithm == "auto":
        raise ValueError(f"argument --cp-comm-type: invalid choice: {bad[0]!r} (choose from "
                         f"{', '.join(repr(c) for c in sorted(BY_CP_COMM_TYPE))}), or set "
                         "--longctx-cp-algorithm")
    check_after_parsing(args)


def _platform_defaults(own: argparse.Namespace) -> list[str]:
    import torch

    data_dir = _data_dir(own)
    argv = ["--data-cache-path", os.path.join(data_dir, "index-cache")]
    if not torch.cuda.is_available():
        argv += ["--distributed-backend", "gloo", "--distributed-timeout-minutes", str(CPU_TIMEOUT_MINUTES),
                 "--distributed-timeout-seconds-after-init", str(CPU_TIMEOUT_AFTER_INIT_S)]
    return argv


def _data_dir(own: argparse.Namespace) -> str:
    return own.data_dir or os.path.join(os.path.dirname(os.path.abspath(own.output_dir)), "data")


def ensure_corpus(own: argparse.Namespace, seq_length: int) -> str:
    """Build (once) the standard-library corpus, with ``--data-passkeys`` prompts of up to ``seq_length``
    tokens; returns its ``--data-path`` prefix."""
    from megatron_longctx import data as data_mod
    from megatron_longctx.job import passkey

    count = own.data_passkeys
    extra = (f"passkeys{count}x{seq_length}", lambda: passkey.documents(count, seq_length)) if count else None
    return data_mod.ensure_stdlib_dataset(_data_dir(own), own.data_max_bytes, data_mod.ByteTokenizer(), extra)


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
