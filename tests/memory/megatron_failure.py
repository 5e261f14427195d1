"""Run Megatron's own selective recompute of one module on the CPU and print how it ends.

``python -m tests.memory.megatron_failure {mlp|layernorm}`` prints ``FORWARD DONE`` after the forward,
then ``OK`` or ``FAILED <ExceptionType>``.
Run in a subprocess (the ``mlp`` case recurses without end): the caller bounds it with a timeout.
"""

import datetime
import os
import sys

import torch.distributed as dist


def main(module: str) -> None:
    sys.setrecursionlimit(400)
    from tests.dist import free_port, megatron_parallel
    from tests.gpt_kit import ORACLE, ORACLE_SEQ, batch, build_gpt, cpu

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        with cpu(), megatron_parallel():
            model = build_gpt(**ORACLE, recompute_granularity="selective", recompute_modules=[module], add_bias_linear=True)
            b = batch(seq=ORACLE_SEQ)
            tokens, pos = b["tokens"], b["position_ids"]
            loss = model(tokens, pos, None, labels=tokens).sum()
            print("FORWARD DONE", flush=True)
            loss.backward()
        print("OK", flush=True)
    except BaseException as exc:  # noqa: BLE001 - the point is to report it
        print(f"FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    finally:
        dist.destroy_process_group()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
