"""Passkey retrieval prompts in byte tokens: a key hidden at a given depth of a filler text, asked for at the end.

A prompt of exactly ``length`` tokens::

    <filler ...> The pass key is 48213. Remember it. 48213 is the pass key. <filler ...>
    What is the pass key? The pass key is 48213

The needle starts at ``depth`` (0: the start, 1: just before the question) of the filler; the last
:data:`DIGITS` tokens are the answer, which the model retrieves when it predicts every one of them
(teacher-forced greedy: the argmax at each position before an answer token is that token).
"""

from __future__ import annotations

import dataclasses
import random

from megatron_longctx.data import ByteTokenizer

DIGITS = 5
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclasses.dataclass(frozen=True)
class Passkey:
    """One prompt: ``tokens`` (``length`` byte tokens) and where the key is in it."""

    tokens: list[int]
    key: str
    needle_key: tuple[int, int]  # [start, end) of the key's first occurrence in the needle
    answer: tuple[int, int]  # [start, end) of the answer: the last DIGITS tokens
    depth: float


def needle(key: str) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key. "


def question(key: str) -> str:
    return f" What is the pass key? The pass key is {key}"


def make(length: int, depth: float, seed: int) -> Passkey:
    """The prompt of ``length`` tokens with a key drawn from ``seed``, its needle at ``depth`` in [0, 1]."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth {depth}: must be in [0, 1]")
    key = f"{random.Random(seed).randrange(10 ** (DIGITS - 1), 10 ** DIGITS)}"
    inner, tail = needle(key).encode(), question(key).encode()
    room = length - len(inner) - len(tail)
    if room < 0:
        raise ValueError(f"passkey length {length}: a prompt needs at least {len(inner) + len(tail)} tokens")
    filler = (FILLER.encode() * (room // len(FILLER) + 1))[:room]
    at = round(depth * room)
    text = filler[:at] + inner + filler[at:] + tail  # exactly length bytes
    key_at = at + len(" The pass key is ")
    tokens = ByteTokenizer().tokenize(text.decode())
    return Passkey(tokens=tokens, key=key, needle_key=(key_at, key_at + DIGITS), answer=(length - DIGITS, length),
                   depth=at / max(room, 1))


# Seeds of the training documents: a stream apart from evaluation's (``1000 * trial + 17``).
TRAIN_SEED = 10_000_000


def minimum_length() -> int:
    """The shortest prompt: the needle and the question with no filler."""
    return len(needle("0" * DIGITS)) + len(question("0" * DIGITS))


def documents(count: int, max_length: int, seed: int = TRAIN_SEED) -> list[list[int]]:
    """``count`` prompts for a training corpus: lengths uniform from twice :func:`minimum_length` to
    ``max_length``, needles at uniform depths, each key drawn from its own seed."""
    low = 2 * minimum_length()
    if max_length < low:
        raise ValueError(f"--data-passkeys: prompts need at least {low} tokens, the run's --seq-length is "
                         f"{max_length}; raise --seq-length or drop --data-passkeys")
    draw = random.Random(seed)
    return [make(draw.randint(low, max_length), draw.random(), seed + 1 + i).tokens for i in range(count)]
