"""Training data for the main job and the benchmark: the standard library's sources as a Megatron dataset.

Nothing is downloaded.  The text is the ``.py`` files of the running interpreter's standard library
(sorted by path, so every machine with the same Python version sees the same corpus); the tokenizer is
byte-level (:class:`ByteTokenizer`, vocabulary 256 bytes + end-of-document + padding), which is exact,
reversible and needs no vocabulary file.  The corpus is written once with Megatron's
``IndexedDatasetBuilder`` (``.bin``/``.idx``) and read with Megatron's ``GPTDataset`` through
``BlendedMegatronDatasetBuilder`` (its document/sample/shuffle indices come from Megatron's compiled
``helpers_cpp``, shipped in the megatron-core wheel for CPU and GPU alike).

Sample order: global sample ``g`` of step ``t`` is ``t·global_batch + g``; every data-parallel and
micro-batch split of a step reads its samples by that index, so runs with different parallel layouts
(CP=2 vs DP=2) see the same tokens in the same order.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

EOD = 256
PAD = 257


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, ``eod`` = 256, ``pad`` = 257 (vocabulary 258, no merges, offline).

    Has the attributes Megatron's ``GPTDatasetConfig``/``GPTDataset`` read from a tokenizer
    (``vocab_size``, ``eod``, ``pad``, ``unique_identifiers``).
    """

    vocab_size: int = 258
    eod: int = EOD
    pad: int = PAD

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        return {"class": "ByteTokenizer", "vocab_size": self.vocab_size, "eod": self.eod, "pad": self.pad}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def padded_vocab_size(tokenizer: ByteTokenizer, multiple: int = 64) -> int:
    """The model's vocabulary: the tokenizer's rounded up to ``multiple`` (TP-divisible, as Megatron pads)."""
    return -(-tokenizer.vocab_size // multiple) * multiple


def stdlib_sources(max_bytes: int) -> list[str]:
    """Paths of the standard library's ``.py`` files (sorted), at most ``max_bytes`` of them in total."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    paths = [p for p in paths if "site-packages" not in p and "test" not in os.path.relpath(p, root).split(os.sep)[0]]
    chosen, total = [], 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        chosen.append(path)
        total += size
        if total >= max_bytes:
            break
    if not chosen:
        raise ValueError(f"no Python sources found under {root}; pass --data-prefix with a prebuilt dataset")
    return chosen


def write_indexed_dataset(prefix: str, paths: list[str], tokenizer: ByteTokenizer,
                          extra: Sequence[Sequence[int]] = ()) -> int:
    """Tokenize ``paths`` (one document each, EOD-terminated), then the token lists of ``extra`` (one document
    each), into ``prefix.bin``/``prefix.idx``; returns tokens."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=np.uint16)
    total = 0
    sources = [*((path, None) for path in paths), *((None, tokens) for tokens in extra)]
    for path, tokens in sources:
        if path is not None:
            with open(path, "rb") as f:
                data = np.frombuffer(f.read(), dtype=np.uint8).astype(np.int64)  # [bytes]
        else:
            data = np.asarray(tokens, dtype=np.int64)  # [tokens]
        doc = np.append(data, tokenizer.eod)  # [tokens + 1]
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
        total += doc.size
    builder.finalize(prefix + ".idx.tmp")
    os.replace(prefix + ".bin.tmp", prefix + ".bin")
    os.replace(prefix + ".idx.tmp", prefix + ".idx")
    return total


def ensure_stdlib_dataset(data_dir: str, max_bytes: int, tokenizer: ByteTokenizer,
                          extra: Optional[tuple[str, Callable[[], Sequence[Sequence[int]]]]] = None) -> str:
    """Build (rank 0, once) the standard-library corpus under ``data_dir``; every rank returns its prefix.

    ``extra``: ``(name, documents)``: the token lists ``documents()`` returns are added as documents of their
    own, in a corpus of its own (``name`` in its prefix)."""
    prefix = os.path.join(data_dir, f"stdlib_{max_bytes}" + (f"_{extra[0]}" if extra else ""))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0 and not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
        write_indexed_dataset(prefix, stdlib_sources(max_bytes), tokenizer, extra[1]() if extra else ())
    if dist.is_initialized():
        dist.barrier()
    return prefix


def build_gpt_dataset(prefix: str, seq_length: int, num_samples: int, seed: int, tokenizer: ByteTokenizer,
                      cache_dir: Optional[str] = None) -> Any:
    """Megatron's training ``GPTDataset`` over ``prefix`` with at least ``num_samples`` samples of ``seq_length``.

    Every sample is ``{"tokens", "labels", "loss_mask", "position_ids"}``, each ``[seq_length]``.
    Must be called on every rank (Megatron builds the index files on rank 0 and the others wait).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=([prefix], None), split="100,0,0",
        path_to_cache=cache_dir or os.path.join(os.path.dirname(prefix), "index-cache"),
        tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, None, None], lambda: True, config).build()
    if train is None or len(train) < num_samples:
        raise ValueError(f"the dataset at {prefix} holds {0 if train is None else len(train)} samples of "
                         f"{seq_length} tokens, {num_samples} needed: raise --data-max-bytes or lower --seq-length")
    return train


def global_batch(dataset: Any, step: int, global_batch_size: int) -> dict[str, torch.Tensor]:
    """The samples of ``step`` stacked: tensors ``[global_batch, s]`` (samples ``step·gbs`` ... ``+gbs-1``)."""
    samples = [dataset[step * global_batch_size + i] for i in range(global_batch_size)]
    return {k: torch.stack([s[k] for s in samples]) for k in ("tokens", "labels", "loss_mask", "position_ids")}
