"""One rank of the main job: Megatron-LM's ``pretrain`` with the plugin's providers.

Started by :mod:`megatron_longctx.job.pretrain` under ``torchrun``::

    python -m torch.distributed.run ... -m megatron_longctx.job.worker <Megatron and --longctx-* flags>

The run-level settings that are not Megatron flags (which phase this is, where the per-step metrics
go, whether to draw a progress bar, where to leave a failure marker) come in the JSON environment
variable :data:`JOB_ENV`.  Hooks are put around Megatron's own functions for the duration of the
run, and nothing else is changed:

* ``train_step``: each finished step's loss (Megatron's ``lm loss``, reduced over ``dp_cp``), grad norm,
  learning rate, the sequence length its batches had (``--mix-short``: per step), time and memory per rank
  (CUDA peak; on CPU the RSS added since start, read at the end of the step) go to ``metrics.jsonl`` and
  the progress bar;
* ``update_pg_timeout``: the after-init timeout reaches every process group (the plugin's too);
* ``save_checkpoint``: once Megatron has written an iteration folder and its tracker file, the
  integrity manifest of that folder is written (:mod:`megatron_longctx.job.checkpoint_guard`);
* ``compile_helpers`` skipped when the wheel's compiled ``helpers_cpp`` imports, and ``_print_args``
  shortened to one line.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megatron_longctx.memory.accounting import peak_rss_bytes
from megatron_longctx.patching import Patch, patch

JOB_ENV = "LONGCTX_JOB"


def job_settings() -> dict[str, Any]:
    return json.loads(os.environ.get(JOB_ENV, "{}"))


class StepLog:
    """Per-step rows on rank 0 (``metrics.jsonl``) and a tqdm bar; peaks gathered from every rank."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.name = settings.get("name", "plugin")
        self.metrics = settings.get("metrics")
        self.progress = settings.get("progress", True)
        self.total = settings.get("total_steps")
        self.bar: Any = None
        self.started = False

    def _rank0(self) -> bool:
        return dist.get_rank() == 0

    def _start(self, first: int) -> None:
        self.started = True
        if not (self.progress and self._rank0()):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self.bar = tqdm(total=self.total, initial=first, desc=self.name, unit="step", dynamic_ncols=True,
                        file=sys.stdout)

    def peaks(self) -> list[int]:
        if torch.cuda.is_available():
            local = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:  # the step's peak resident memory, the process's own included (as the peak RSS is counted)
            local = peak_rss_bytes(reset=True)
        t = torch.zeros(dist.get_world_size(), dtype=torch.int64,
                        device="cuda" if torch.cuda.is_available() else "cpu")
        t[dist.get_rank()] = local  # [world], one slot per rank
        dist.all_reduce(t)
        return [int(x) for x in t]

    def add(self, step: int, loss: float, grad_norm: Optional[float], lr: float, seconds: float,
            batch: tuple[int, int], offload: Optional[dict[str, int]] = None) -> None:
        """``batch``: the step's (global batch size, sequence length)."""
        tokens = batch[0] * batch[1]
        row = {"run": self.name, "step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
               "step_time_s": seconds, "seq_length": batch[1], "tokens": tokens,
               "tokens_per_s": tokens / max(seconds, 1e-9),
               "peak_mem_bytes_per_rank": self.peaks(),
               "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        if offload:
            row["offload"] = offload  # rank 0's activation offload counters since the start (bytes, tensors)
        if not self._rank0():
            return
        if not self.started:
            self._start(step - 1)
        if self.metrics:
            with open(self.metrics, "a") as f:
                f.write(json.dumps(row) + "\n")
        mem = max(row["peak_mem_bytes_per_rank"]) / 2**20
        text = f"loss {loss:.4f}  tok/s {row['tokens_per_s']:.0f}  mem/rank {mem:.0f} MiB"
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)
        else:
            print(f"[{self.name}] step {step}/{self.total}  {text}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class StallWatchdog:
    """Ends this rank when no step finishes within ``--distributed-timeout-seconds-after-init``.

    Megatron applies that timeout to its groups with ``set_timeout``, which gloo's point-to-point sends
    and receives (the CP ring) do not honour: they keep the creation-time ``--distributed-timeout-minutes``.
    This thread holds the same bound per step (and per checkpoint save) on every rank, so a stuck peer
    fails the job within the time the user set.
    """

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.seconds: Optional[float] = None
        self.last = time.monotonic()
        self.thread: Optional[threading.Thread] = None

    def beat(self, seconds: Optional[float]) -> None:
        self.last = time.monotonic()
        if seconds is not None and self.thread is None:
            self.seconds = float(seconds)
            self.thread = threading.Thread(target=self._watch, daemon=True)
            self.thread.start()

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            idle = time.monotonic() - self.last
            if self.seconds is not None and idle > self.seconds:
                rank = os.environ.get("RANK", "0")
                message = (f"rank {rank}: no step finished for {idle:.0f} s (--distributed-timeout-seconds-after-init "
                           f"{self.seconds:.0f}): a rank is stuck or too slow; timeout")
                print(message, file=sys.stderr, flush=True)
                _fail_marker(self.settings, message)
                os._exit(EXIT_STALLED)


EXIT_STALLED = 3


def _wrap_train_step(original: Callable, log: StepLog, watchdog: StallWatchdog) -> Callable:
    from megatron_longctx.job import providers

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        margs = get_args()
        watchdog.beat(None)
        optimizer = args[3] if len(args) > 3 else kwargs["optimizer"]
        lr = float(optimizer.param_groups[0]["lr"])  # the rate this step uses
        providers.batch_lengths.clear()
        start = time.perf_counter()
        out = original(*args, **kwargs)
        seconds = time.perf_counter() - start
        lengths = set(providers.batch_lengths)
        if len(lengths) > 1:
            raise RuntimeError(f"step {margs.curr_iteration + 1} read micro-batches of lengths {sorted(lengths)}: a "
                               "global batch must have one sequence length")
        watchdog.beat(margs.distributed_timeout_seconds_after_init)
        loss_dict, skipped, grad_norm = out[0], out[1], out[5]
        if "lm loss" in loss_dict and not skipped:
            value = loss_dict["lm loss"]
            loss = float(value.item() if isinstance(value, torch.Tensor) else value)
            step = margs.curr_iteration + 1
            length = lengths.pop() if lengths else margs.seq_length  # what the step read (--mix-short: per step)
            model = args[2] if len(args) > 2 else kwargs.get("model")
            log.add(step, loss, None if grad_norm is None else float(grad_norm), lr, seconds,
                    (margs.global_batch_size, length), _offload_stats(model))
        return out

    return train_step


def _offload_stats(model: Any) -> dict[str, int]:
    """The activation offload counters of the plugin's memory features on ``model`` (``{}``: none)."""
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        while chunk is not None and not hasattr(chunk, "_longctx_memory_handle") and hasattr(chunk, "module"):
            chunk = chunk.module  # DDP / Float16Module wrappers
        handle = getattr(chunk, "_longctx_memory_handle", None)
        if handle is not None and handle.offloader is not None:
            return handle.stats()
    return {}


def _wrap_save_checkpoint(original: Callable, watchdog: StallWatchdog) -> Callable:
    from megatron_longctx.job import checkpoint_guard

    @functools.wraps(original)
    def save_checkpoint(iteration: int, *args: Any, **kwargs: Any) -> Any:
        from megatron.training import get_args

        watchdog.beat(None)
        out = original(iteration, *args, **kwargs)
        watchdog.beat(None)
        save_dir = get_args().save
        if dist.get_rank() == 0:
            checkpoint_guard.write_manifest(save_dir, iteration)
        dist.barrier()
        return out

    return save_checkpoint


def _install_hooks(log: StepLog, watchdog: StallWatchdog) -> list[Patch]:
    from megatron.core.datasets import utils as datasets_utils
    from megatron.training import arguments, training

    from megatron_longctx.megatron.script_setup import wrap_compile_helpers

    targets = [(training, "train_step", lambda f: _wrap_train_step(f, log, watchdog)),
               (training, "save_checkpoint", lambda f: _wrap_save_checkpoint(f, watchdog)),
               (datasets_utils, "compile_helpers", wrap_compile_helpers),  # the wheel ships helpers_cpp, no Makefile
               (arguments, "_print_args", lambda f: _quiet_print_args),
               (training, "update_pg_timeout", _wrap_update_pg_timeout)]  # 900 lines of argument dump
    return [patch(owner, name, wrap(getattr(owner, name)), "megatron-longctx run: the main job's hooks")
            for owner, name, wrap in targets]


def _wrap_update_pg_timeout(original: Callable) -> Callable:
    """Megatron's ``--distributed-timeout-seconds-after-init`` for every live group, not only Megatron's list:
    the plugin's attention groups too (a stuck peer there must fail the job as soon as one in DDP would)."""

    @functools.wraps(original)
    def update_pg_timeout(timeout: Any, pg: Any = None) -> Any:
        out = original(timeout, pg)
        if pg is None:
            from torch.distributed import distributed_c10d

            for group in list(distributed_c10d._world.pg_map):
                distributed_c10d._set_pg_timeout(timeout, group)
        return out

    return update_pg_timeout


def _quiet_print_args(title: str, args: Any, *rest: Any, **kwargs: Any) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"[megatron] {title}: {len(vars(args))} set (the job's flags are in its command line)", flush=True)


def _fail_marker(settings: dict[str, Any], message: Optional[str] = None) -> None:
    """Tell the launcher this rank failed, so it ends the job now rather than after torchrun's grace."""
    folder = settings.get("marker_dir")
    if folder:
        rank = os.environ.get("RANK", "0")
        with open(os.path.join(folder, f"rank{rank}.failed"), "w") as f:
            f.write(message or traceback.format_exc())


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = job_settings()
    try:
        return _run(argv, settings)
    except SystemExit as exc:  # Megatron's --exit-interval / signal handler exit: fine when the code is 0
        if exc.code not in (0, None):
            _fail_marker(settings)
        raise
    except BaseException:
        _fail_marker(settings)
        raise


def _run(argv: list[str], settings: dict[str, Any]) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core.enums import ModelType
    from megatron.training import training
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_longctx.megatron import cpu_compat
    from megatron_longctx.job import mix, providers
    from megatron_longctx.megatron.arguments import add_longctx_args_taking_flags

    sys.argv = [sys.argv[0], *argv]
    log = StepLog(settings)
    watchdog = StallWatchdog(settings)
    saved = _install_hooks(log, watchdog)
    saved.append(patch(providers, "job_mix", mix.from_settings(settings), "megatron-longctx run: --mix-short"))
    if "evaluate" in settings:  # megatron-longctx eval: a forward-only pass where Megatron's train loop was
        from megatron_longctx.job.eval_forward import replace_train

        saved.append(replace_train(settings["evaluate"]))
    try:
        with cpu_compat.enabled():
            args = parse_and_validate_args(extra_args_provider=add_longctx_args_taking_flags)
            full_config = pretrain_cfg_container_from_args(args)  # no model config: our model_provider builds it
            training.pretrain(full_config, providers.train_valid_test_datasets_provider, ModelType.encoder_or_decoder,
                              providers.forward_step, model_provider=providers.model_provider)
    finally:
        watchdog.seconds = None  # training is over: nothing to watch
        log.close()
        for done in reversed(saved):
            done.undo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
