"""Pretraining data: Megatron's GPTDataset (or its mock) through BlendedMegatronDatasetBuilder.

Samples are consumed in Megatron-LM's order: global batch ``i`` is samples
``[i*G, (i+1)*G)`` and each data-parallel rank takes every DP-th micro-batch slice of it, so the
data position is one number (consumed samples) that stays valid when the layout changes.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from anyspeed.errors import UsageError


class DatasetTokenizer:
    """The few tokenizer facts Megatron's GPTDataset reads: vocabulary size, EOD and pad ids."""

    def __init__(self, vocab_size: int, eod: int, pad: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eod = eod
        self._pad = pad
        # Part of the dataset cache key Megatron hashes (must be JSON-serialisable).
        self.unique_identifiers = {
            "class": "anyspeed.DatasetTokenizer",
            "vocab_size": vocab_size,
            "eod": eod,
            "pad": pad,
        }

    @property
    def pad(self) -> int:
        if self._pad is None or self._pad == self.eod:
            raise AttributeError("no distinct pad token")  # GPTDataset then uses its own
        return self._pad


def max_token_id(bin_path: str, dtype: np.dtype) -> int:
    """Largest token id stored in a ``.bin`` (one streaming pass over a memory map)."""
    if os.path.getsize(bin_path) == 0:
        return -1
    data = np.memmap(bin_path, dtype=dtype, mode="r")
    top, step = 0, 1 << 24
    for i in range(0, data.size, step):
        top = max(top, int(data[i : i + step].max()))
    return top


def split_tokens(lengths: np.ndarray, split: str) -> list[int | None]:
    """Tokens in each split (train, valid, test) of a dataset with these sequence lengths,
    under Megatron's own rule for ``--split`` (documents by rounded share); None for a split
    with no share."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    n = lengths.shape[0]
    out: list[int | None] = []
    for bounds in convert_split_vector_to_split_matrix(parse_and_normalize_split(split)):
        if bounds is None:
            out.append(None)
            continue
        beg, end = int(round(bounds[0] * n)), int(round(bounds[1] * n))
        out.append(int(np.asarray(lengths[beg:end]).sum(dtype=np.int64)))
    return out


def data_blend(args: argparse.Namespace) -> tuple[list[str], list[float] | None]:
    """``--data-path`` as (prefixes, weights); weights None when only prefixes are given."""
    items = list(args.data_path or [])
    if len(items) > 1 and _is_number(items[0]):
        if len(items) % 2:
            raise UsageError("--data-path: give WEIGHT PREFIX pairs (an odd number of items)")
        weights = [float(w) for w in items[0::2]]
        if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
            raise UsageError(
                f"--data-path: the weights {items[0::2]} must be >= 0 and not all zero"
            )
        return items[1::2], weights
    if any(_is_number(x) for x in items):
        raise UsageError("--data-path: either all PREFIX or WEIGHT PREFIX pairs, not a mix")
    return items, None


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def dataset_tokenizer(args: argparse.Namespace, tok: Any = None) -> DatasetTokenizer:
    if tok is not None:
        eod = tok.eod_id if tok.eod_id is not None else args.padded_vocab_size - 1
        return DatasetTokenizer(tok.vocab_size, eod, tok.pad_id)
    return DatasetTokenizer(args.padded_vocab_size, args.padded_vocab_size - 1)


def num_samples(args: argparse.Namespace) -> list[int]:
    """Samples needed per split (train, valid, test), as Megatron-LM counts them."""
    g = args.global_batch_size
    evals = (args.train_iters // args.eval_interval + 1) * args.eval_iters if args.eval_iters else 0
    return [args.train_iters * g, evals * g, args.eval_iters * g]


def build_datasets(args: argparse.Namespace, tokenizer: Any = None) -> list[Any]:
    """(train, valid, test) datasets; None for a split with no share of the data, and for
    validation and test under ``--eval-iters 0``."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

    blend = None if args.mock_data else data_blend(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=dataset_tokenizer(args, tokenizer),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.reset_attention_mask,
    )
    if not args.eval_iters:  # nothing is evaluated: build (and need documents for) training only
        config.split_matrix = [config.split_matrix[0], None, None]
    cls = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, num_samples(args), lambda: True, config).build()


def batches(
    dataset: Any, args: argparse.Namespace, consumed: int, device: torch.device
) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Yield, per iteration, this rank's micro-batches of the next global batch.

    Starts after ``consumed`` samples; tensors are on ``device``, split along the sequence for
    context parallelism the way Megatron does (load-balanced chunks).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs, g = args.micro_batch_size, args.global_batch_size
    while True:
        if consumed + g > len(dataset):
            return
        micro = []
        for start in range(consumed, consumed + g, mbs * dp):
            lo = start + rank * mbs
            samples = [dataset[i] for i in range(lo, lo + mbs)]
            batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            if "attention_mask" in batch:  # Megatron's masks: True where attention is blocked
                batch["attention_mask"] = batch["attention_mask"].bool()
            micro.append(get_batch_on_this_cp_rank(batch))
        consumed += g
        yield micro
