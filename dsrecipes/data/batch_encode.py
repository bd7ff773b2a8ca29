"""Tokenize every conversation of a preparation, in `data.preprocess_workers` processes (chunks of CHUNK).

The result is flat: one int32 array of all token ids and one of labels, with per-conversation starts and lengths,
so splitting, mixing and packing only index arrays (prepare.py, arrow_split.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from dsrecipes.config.schema import TrainConfig
from dsrecipes.data.badrows import BadRow
from dsrecipes.data.sharegpt import Conversation
from dsrecipes.data.tokenize import Encoder

CHUNK = 512  # conversations per tokenization task


@dataclass
class Encoded:
    """All conversations tokenized: sample i's tokens are flat[starts[i]:starts[i]+lengths[i]] (length 0: none)."""

    input_ids: np.ndarray
    labels: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray
    kept: np.ndarray  # indices of conversations with an Example
    dropped: List[int]  # nothing trained left after truncation
    bad: List[Tuple[int, Tuple[Any, str]]]  # (conversation index, (BadReason, detail)) from the template


_worker_encoder: Optional[Encoder] = None


def _init_worker(tokenizer: Any, cfg: TrainConfig) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker_encoder = Encoder(tokenizer, cfg)


def _encode_chunk(args: Tuple[int, List[Conversation]]):
    start, convs = args
    assert _worker_encoder is not None
    errors: List[Tuple[Conversation, BadRow]] = []
    examples = _worker_encoder.encode_batch(convs, errors)
    bad_ids = {id(c): b for c, b in errors}
    lengths = np.zeros(len(convs), dtype=np.int64)
    truncated = np.zeros(len(convs), dtype=bool)
    ids: List[int] = []
    labels: List[int] = []
    bad, dropped = [], []
    for k, (conv, ex) in enumerate(zip(convs, examples)):
        if ex is None:
            b = bad_ids.get(id(conv))
            if b is not None:
                bad.append((start + k, (b.reason, b.detail)))
            else:
                dropped.append(start + k)
            continue
        lengths[k] = len(ex.input_ids)
        truncated[k] = ex.truncated
        ids += ex.input_ids
        labels += ex.labels
    return np.asarray(ids, np.int32), np.asarray(labels, np.int32), lengths, truncated, bad, dropped


def encode_all(convs: Sequence[Conversation], tokenizer: Any, cfg: TrainConfig) -> Encoded:
    tasks = [(s, list(convs[s: s + CHUNK])) for s in range(0, len(convs), CHUNK)]
    workers = min(cfg.data.preprocess_workers, len(tasks))
    if workers <= 1:
        _init_worker_local(tokenizer, cfg)
        results = [_encode_chunk(t) for t in tasks]
    else:
        with get_context().Pool(workers, initializer=_init_worker, initargs=(tokenizer, cfg)) as pool:
            results = list(pool.imap(_encode_chunk, tasks))
    cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))
    lengths = cat([r[2] for r in results], np.int64)
    return Encoded(
        input_ids=cat([r[0] for r in results], np.int32),
        labels=cat([r[1] for r in results], np.int32),
        starts=np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths,
        lengths=lengths,
        truncated=cat([r[3] for r in results], bool),
        kept=np.flatnonzero(lengths > 0),
        dropped=[i for r in results for i in r[5]],
        bad=[b for r in results for b in r[4]],
    )


def _init_worker_local(tokenizer: Any, cfg: TrainConfig) -> None:
    global _worker_encoder
    _worker_encoder = Encoder(tokenizer, cfg)

