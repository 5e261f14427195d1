"""Peak RSS and step time of a plain layer stack with its model states streamed (host, disk) or not (none).

Each mode runs in its own process: ``python scripts/bench_model_states.py [--layers 8 --hidden 1024 ...]``
prints a table and writes JSON (``--out``).  On the CPU the device slots are host tensors, so ``host`` keeps
the whole model in memory (its off-device copy) and only ``disk`` lowers the footprint.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _one(mode: str, a: argparse.Namespace) -> dict:
    import torch
    import torch.nn.functional as F

    from megatron_longctx.memory.accounting import peak_rss_bytes, rss_bytes
    from megatron_longctx.memory.host_pool import HostPool
    from megatron_longctx.memory.model_states import ModelStateStreamer, StreamOptions

    torch.set_num_threads(1)
    base = rss_bytes()  # torch imported, nothing built

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(a.hidden)
            self.qkvo = torch.nn.Linear(a.hidden, 4 * a.hidden, bias=False)
            self.up = torch.nn.Linear(a.hidden, 2 * a.ffn, bias=False)
            self.down = torch.nn.Linear(a.ffn, a.hidden, bias=False)

        def forward(self, x):
            y = self.norm(x)
            q = self.qkvo(y)[..., :a.hidden]
            gate, up = self.up(y).chunk(2, dim=-1)
            return x + q + self.down(F.silu(gate) * up)

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Block() for _ in range(a.layers))
    streamer = None
    if mode != "none":
        streamer = ModelStateStreamer(list(blocks), StreamOptions(
            target=mode, device=torch.device("cpu"), pool=HostPool(64 << 30, pin=False),
            disk_dir=tempfile.mkdtemp(dir=a.disk_dir) if mode == "disk" else None))
    x0 = torch.randn(1, a.seq, a.hidden)
    peak_rss_bytes(reset=True)
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        x = x0.requires_grad_()
        for b in blocks:
            x = b(x)
        x.float().pow(2).mean().backward()
        if streamer is not None:
            streamer.finish_backward()
            streamer.zero_grad()
        else:
            for p in blocks.parameters():
                p.grad = None
        times.append(time.perf_counter() - t)
    return {"mode": mode, "base_rss_gb": base / 1e9, "peak_rss_gb": peak_rss_bytes() / 1e9, "rss_gb": rss_bytes() / 1e9,
            "step_s": min(times), "params_m": sum(p.numel() for p in blocks.parameters()) / 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--disk-dir", default=None)
    p.add_argument("--out", default="bench_model_states.json")
    p.add_argument("--mode", choices=["none", "host", "disk"], default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.mode:
        print(json.dumps(_one(a.mode, a)))
        return
    from megatron_longctx.memory.accounting import RSS_TRACKS_TENSORS_ENV

    rows = []
    for mode in ("none", "host", "disk"):
        cmd = [sys.executable, __file__, "--mode", mode] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                                                              if k not in ("mode", "out") and v is not None]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, **RSS_TRACKS_TENSORS_ENV}).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'mode':6} {'params (M)':>10} {'base RSS (GB)':>13} {'peak RSS (GB)':>14} {'step (s)':>9}")
    for r in rows:
        print(f"{r['mode']:6} {r['params_m']:10.1f} {r['base_rss_gb']:13.2f} {r['peak_rss_gb']:14.2f} "
              f"{r['step_s']:9.2f}")
    with open(a.out, "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
