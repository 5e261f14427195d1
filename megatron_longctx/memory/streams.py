"""The CUDA stream calls of the activation offloader, in one object a test double can stand in for.

Contract (what the offloader does with these calls, and why it is safe):

* **Off the device** (forward): ``wait_stream(side, compute)`` so the copy reads the finished tensor;
  the copy into the host buffer on ``side``; an event recorded after it; ``record_stream(src, side)``;
  then the offloader drops its reference to ``src`` at once.  The caching allocator does not reuse
  ``src``'s memory before the side stream has passed the copy, so the device copy is released as soon
  as the copy has landed, without anyone polling.
* **Back on the device** (backward): the buffer is allocated on the *compute* stream (so it is an
  ordinary compute-stream tensor, like the one autograd would have saved: any second stream that
  reads it follows the same rules as without offload); ``wait_stream(side, compute)`` (the memory may
  have just been freed by compute-stream work); ``wait_event(side, copied)``; the copy on ``side``;
  an event; ``record_stream(buf, side)``.  Before the tensor is handed to autograd,
  ``wait_event(compute, fetched)``.
* **Rows back on the device** (a tile of a layer replayed in tiles, a tile of the residual gradient):
  the buffer is a *side-stream* allocation, so the copy waits for no compute-stream work (only for the
  event of the copy that filled the host rows, if that was another stream's); the next tile's copy is
  started before this tile is handed over, into a second buffer.  Handing a tile over:
  ``wait_event(compute, that tile's event)`` and ``record_stream(buf, compute)`` (the side stream does
  not reuse the memory before the compute stream is done with it).  Rows going back to the host follow
  the "off the device" order above.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class CudaOps:
    """The real calls (CUDA streams and events)."""

    def is_device(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def wait_stream(self, waiter: Any, waitee: Any) -> None:
        waiter.wait_stream(waitee)

    def record_event(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def done(self, event: Any) -> bool:
        return event.query()

    def sync_event(self, event: Any) -> None:
        event.synchronize()

    def sync_stream(self, stream: Any) -> None:
        stream.synchronize()

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)


def device_ops() -> CudaOps:
    """The ops a new offloader uses (tests replace this function to record the calls' order)."""
    return CudaOps()
