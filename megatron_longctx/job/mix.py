"""Mixed short/long batches: some steps of a long-context run train on short sequences.

Long-context continued pretraining keeps the model's short-context ability by mixing short sequences in
(Nemotron's long phase alternates 1M- and 4K-token sequences).  ``--mix-short SHORT:FRACTION`` (on
``megatron-longctx run``; a stage ``LENGTH:STEPS@SHORT:FRACTION`` of ``extend``) makes ``FRACTION`` of the
steps train on ``SHORT``-token sequences and the others on ``--seq-length``, spread evenly: step ``k``
(1-based) is short when ``floor(k·FRACTION)`` exceeds ``floor((k-1)·FRACTION)``, so ``0.5`` alternates long
and short, ``0.25`` makes every fourth step short.  A whole global batch has one length (every micro-batch
of a step draws its samples from that step's slice of the sampler), and which steps are short depends on
the step number only, so a resumed run continues the same pattern.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

from megatron_longctx.plan.model import parse_tokens

FLAG = "--mix-short"


@dataclasses.dataclass(frozen=True)
class Mix:
    """``fraction`` of the steps train on ``short``-token sequences."""

    short: int
    fraction: float

    def text(self) -> str:
        return f"{self.short}:{self.fraction:g}"


def pair(text: str, first: Callable[[str], Any], second: Callable[[str], Any]) -> tuple:
    """``"A:B"`` as ``(first(A), second(B))``; ``ValueError`` when it is not of that shape."""
    a, sep, b = text.partition(":")
    if not sep:
        raise ValueError(text)
    return first(a), second(b)


def parse(text: str, flag: str = FLAG) -> Mix:
    """``"4K:0.5"`` -> ``Mix(4096, 0.5)``; ``ValueError`` naming ``flag`` and the fix."""
    try:
        mix = Mix(*pair(text, parse_tokens, float))
    except ValueError:
        raise ValueError(f"{flag} {text!r} is not SHORT:FRACTION; write e.g. 4K:0.5 (half the steps on "
                         "4,096-token sequences)") from None
    if mix.short < 1 or not 0.0 < mix.fraction < 1.0 or math.isnan(mix.fraction):
        raise ValueError(f"{flag} {text!r}: the short length must be >= 1 and the fraction of short steps "
                         "strictly between 0 and 1, e.g. 4K:0.5")
    return mix


def check(mix: Optional[Mix], seq_length: int, context_parallel_size: int, flag: str = FLAG) -> None:
    """The short length against the run's: shorter, and split by CP into 2·CP chunks."""
    if mix is None:
        return
    if mix.short >= seq_length:
        raise ValueError(f"{flag} {mix.text()}: the short length must be below --seq-length {seq_length}; give a "
                         f"shorter one, e.g. {max(1, seq_length // 8)}:{mix.fraction:g}")
    chunks = 2 * context_parallel_size
    if context_parallel_size > 1 and mix.short % chunks:
        raise ValueError(f"{flag} {mix.text()}: the short length must be a multiple of 2 x --context-parallel-size "
                         f"({chunks}); choose e.g. {max(1, mix.short // chunks) * chunks}:{mix.fraction:g}")


def is_short(step: int, fraction: float) -> bool:
    """Whether the 1-based ``step`` trains on short sequences."""
    return math.floor(step * fraction) > math.floor((step - 1) * fraction)


def step_length(step: int, seq_length: int, mix: Optional[Mix]) -> int:
    """The sequence length of the 1-based ``step``."""
    return mix.short if mix is not None and is_short(step, mix.fraction) else seq_length


def from_settings(settings: dict[str, Any]) -> Optional[Mix]:
    value = settings.get("mix_short")
    return None if value is None else Mix(int(value[0]), float(value[1]))


class MixedLengthDataset:
    """Sample ``i`` of step ``i // global_batch_size + 1`` from ``short`` on the mix's short steps, else from
    ``long`` (Megatron's pretraining sampler hands step ``k`` the samples ``k·gbs`` ... ``(k+1)·gbs - 1``)."""

    def __init__(self, long: Any, short: Any, global_batch_size: int, mix: Mix) -> None:
        self.long, self.short, self.global_batch_size, self.mix = long, short, global_batch_size, mix

    def __len__(self) -> int:
        return min(len(self.long), len(self.short))

    def __getitem__(self, index: int) -> Any:
        step = int(index) // self.global_batch_size + 1
        return (self.short if is_short(step, self.mix.fraction) else self.long)[index]
