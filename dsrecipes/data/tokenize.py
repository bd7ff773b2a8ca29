"""Conversations -> token ids + labels (batched), truncation, and packing.

Tokenization is batched: the segments of many conversations go to the fast tokenizer's Rust `encode_batch` in one
call (identical texts, e.g. role headers, once), with `add_special_tokens=False` because templates spell out their
own bos/eos text. Each segment is tokenized on its own, so a trained span never shares a token with the prompt;
segments after the first of a sample are encoded without a SentencePiece start marker (data/spm.py), else a "▁"
tokenizer (Llama-2 / Mistral-v1 style) would put a spurious space at the start of every reply.

Truncation (`data.cutoff_len`) keeps the head and cuts whole turns from the end: a sample keeps the longest run of
complete assistant/tool-call replies that fits. When not even the first reply fits (or that leaves nothing trained,
e.g. `train_on=last_assistant`), the sequence is cut at `cutoff_len` tokens, mid-reply. A sample with no trained
token left is dropped (`encode` returns None) and counted by the caller. Text after the final trained reply (a
template's trailing newline) is never kept.

Bad rows: whatever rendering or tokenizing one conversation raises makes that conversation a bad row
(`template_error`, `too_deep`, `tokenizer_error`), never a crash of the batch it came in: a batch the tokenizer
refuses is retried text by text to find the culprit.

Memory: only the first `cutoff_len` tokens of a sample are ever kept, so a text far longer than that (more than
LONG_TEXT_FACTOR characters per token of `cutoff_len`) is not tokenized whole (the Rust tokenizer needs ~150 bytes
per character of input): its first `cutoff_len + 1` tokens come from prefixes of it, accepted once two prefixes (one
twice the other) agree on them with HEAD_MARGIN tokens to spare. `cutoff_len + 1` tokens of a segment make truncation
decide exactly as the full length would (the segment overflows either way).

Packing (`data.packing=true`): best-fit-decreasing over sample lengths (deterministic: ties keep input order) into
rows of at most `cutoff_len` tokens; `position_ids` restart at 0 for each sample, and the first label of every
sample is -100 so no token is trained to predict across a sample boundary.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

from dsrecipes.config.schema import TrainConfig
from dsrecipes.data.badrows import BadReason, BadRow
from dsrecipes.data.labels import IGNORE_INDEX
from dsrecipes.data.sharegpt import Conversation
from dsrecipes.data.spm import continuation_encoder
from dsrecipes.data.template import Segment, check_template, render
from dsrecipes.data.template_choice import choose_template
from dsrecipes.errors import ConfigError

LONG_TEXT_FACTOR = 8  # characters per token of cutoff_len above which a text is tokenized by its prefixes
HEAD_MARGIN = 64  # tokens a prefix must yield beyond cutoff_len + 1 before its head is trusted


@dataclass
class Example:
    id: str
    input_ids: List[int]
    labels: List[int]
    truncated: bool = False  # turns (or tokens) were cut to fit data.cutoff_len


@dataclass
class PackedRow:
    ids: List[str]
    input_ids: List[int]
    labels: List[int]
    position_ids: List[int]


class Encoder:
    """Renders with `cfg.template`, labels per `cfg.data.train_on`, truncates to `cfg.data.cutoff_len`."""

    def __init__(self, tokenizer: Any, cfg: TrainConfig):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ConfigError("model.tokenizer_path: a fast (Rust `tokenizers`) tokenizer is needed for batched "
                              "tokenization; this one is a slow Python tokenizer")
        template = choose_template(cfg.template, tokenizer, cfg.model.path)  # template=auto outside a launch
        problems = check_template(template, tokenizer)
        if problems:
            raise ConfigError(problems)
        self.tokenizer = tokenizer
        self.template = template
        self.train_on = cfg.data.train_on
        self.cutoff_len = cfg.data.cutoff_len
        self._encode_fast = getattr(backend, "encode_batch_fast", backend.encode_batch)
        self._encode_cont = continuation_encoder(backend)  # None: segments need no different treatment
        self.long_text = LONG_TEXT_FACTOR * (self.cutoff_len + HEAD_MARGIN)

    def render(self, conv: Conversation) -> List[Segment]:
        """Segments of one conversation, or BadRow: a template is code working on untrusted rows, so anything it
        raises belongs to this row."""
        try:
            return render(conv, self.template, self.tokenizer, self.train_on)
        except BadRow:
            raise
        except RecursionError:
            raise BadRow(BadReason.too_deep, "nested too deep to render") from None
        except Exception as exc:  # noqa: BLE001 - jinja, tool-call JSON, ...: this row cannot be rendered
            raise BadRow(BadReason.template_error, f"{type(exc).__name__}: {exc}") from None

    def encode(self, conv: Conversation) -> Optional[Example]:
        return self.encode_batch([conv])[0]

    def encode_batch(self, convs: Sequence[Conversation],
                     errors: Optional[List[Tuple[Conversation, BadRow]]] = None) -> List[Optional[Example]]:
        """One Example per conversation (None: nothing trained left after truncation, or a bad row when `errors`
        collects `(conv, BadRow)` instead of raising)."""
        rendered: List[Optional[List[Segment]]] = []
        for conv in convs:
            try:
                rendered.append(self.render(conv))
            except BadRow as bad:
                if errors is None:
                    raise
                errors.append((conv, bad))
                rendered.append(None)
        index: Dict[Tuple[bool, str], int] = {}  # (continues the sample, text) -> position, each text encoded once
        keys = [[(k > 0 and self._encode_cont is not None, s.text) for k, s in enumerate(segments or ())]
                for segments in rendered]
        for conv_keys in keys:
            for key in conv_keys:
                index.setdefault(key, len(index))
        encoded, refused = self._encode_segments(list(index))
        out: List[Optional[Example]] = []
        for conv, segments, conv_keys in zip(convs, rendered, keys):
            failed = next((refused[index[k]] for k in conv_keys if index[k] in refused), None)
            if failed is not None:
                if errors is None:
                    raise BadRow(BadReason.tokenizer_error, failed)
                errors.append((conv, BadRow(BadReason.tokenizer_error, failed)))
                segments = None
            if segments is None:
                out.append(None)
                continue
            out.append(self._assemble(conv.id, [(encoded[index[key]], s) for key, s in zip(conv_keys, segments)]))
        return out

    def encode_texts(self, texts: List[str], continuation: bool = False) -> List[List[int]]:
        """Token ids of each text; `continuation`: the text goes on from earlier text (no start marker)."""
        if not texts:
            return []
        encode = self._encode_cont if continuation and self._encode_cont is not None else self._encode_fast
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def _encode_segments(self, keys: List[Tuple[bool, str]]) -> Tuple[List[List[int]], Dict[int, str]]:
        """(ids of each (continuation, text), {index: why} of texts the tokenizer refused). Long texts give their
        head only."""
        try:
            return self._segment_ids(keys), {}
        except Exception:  # noqa: BLE001 - find the text(s) the tokenizer refuses, one by one
            pass
        ids: List[List[int]] = []
        refused: Dict[int, str] = {}
        for i, key in enumerate(keys):
            try:
                ids += self._segment_ids([key])
            except Exception as exc:  # noqa: BLE001 - the Rust tokenizer raises TypeError, ValueError, Exception
                ids.append([])
                refused[i] = f"{type(exc).__name__}: {exc}"
        return ids, refused

    def _segment_ids(self, keys: List[Tuple[bool, str]]) -> List[List[int]]:
        """Short texts batched per kind (first segment / continuation), long ones by their head."""
        out: List[Optional[List[int]]] = [None] * len(keys)
        for continuation in (False, True):
            idx = [i for i, (cont, t) in enumerate(keys) if cont is continuation and len(t) <= self.long_text]
            for i, ids in zip(idx, self.encode_texts([keys[i][1] for i in idx], continuation)):
                out[i] = ids
        for i, (cont, text) in enumerate(keys):
            if out[i] is None:
                out[i] = self._head_ids(text, cont)
        return out

    def _head_ids(self, text: str, continuation: bool = False) -> List[int]:
        """The first cutoff_len + 1 tokens of a long text, from prefixes of it (memory bounded by cutoff_len)."""
        need = self.cutoff_len + 1
        size, agreed = self.long_text, None
        while size < len(text):
            ids = self.encode_texts([text[:size]], continuation)[0]
            if len(ids) >= need + HEAD_MARGIN:
                if ids[:need] == agreed:
                    return agreed
                agreed, size = ids[:need], size * 2
            else:
                agreed, size = None, size * 4
        return self.encode_texts([text], continuation)[0][:need]

    def _assemble(self, sample_id: str, parts: List[Tuple[List[int], Segment]]) -> Optional[Example]:
        ids: List[int] = []
        labels: List[int] = []
        turn_ends: List[int] = []
        first_trained = None
        for tok_ids, seg in parts:
            if seg.trained:
                if first_trained is None and tok_ids:
                    first_trained = len(ids)
                labels.extend(tok_ids)
            else:
                labels.extend([IGNORE_INDEX] * len(tok_ids))
            ids.extend(tok_ids)
            if seg.closes_turn:
                turn_ends.append(len(ids))
        if not turn_ends or first_trained is None:
            return None
        full = turn_ends[-1]
        keep = full
        if full > self.cutoff_len:
            keep = max((e for e in turn_ends if e <= self.cutoff_len), default=0)
            if keep <= first_trained:  # whole turns leave nothing trained: cut mid-reply instead
                keep = self.cutoff_len
        if keep <= first_trained:
            return None
        return Example(sample_id, ids[:keep], labels[:keep], truncated=keep < full)


# --------------------------------------------------------------------------------------------------------------
# Packing


def pack_plan(lengths: Sequence[int], cutoff_len: int) -> List[List[int]]:
    """Best-fit-decreasing: indices of samples per row, rows in creation order, samples in placement order.

    Longest first (ties in input order); each goes to the open row with the least room that still fits it, else
    a new row. Open rows are bucketed by free room, so a placement costs O(log cutoff_len).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: List[List[int]] = []
    rooms: List[int] = []  # sorted distinct free-room values that have open rows
    by_room: Dict[int, Deque[int]] = {}  # free room -> open rows with that room (oldest first)
    for i in order:
        length = lengths[i]
        if length > cutoff_len:
            raise ValueError(f"sample of {length} tokens exceeds cutoff_len={cutoff_len}")
        j = bisect.bisect_left(rooms, length)
        if j < len(rooms):
            room = rooms[j]
            bucket = by_room[room]
            row = bucket.popleft()
            if not bucket:
                del by_room[room]
                rooms.pop(j)
        else:
            room, row = cutoff_len, len(rows)
            rows.append([])
        rows[row].append(i)
        room -= length
        if room > 0:
            if room not in by_room:
                bisect.insort(rooms, room)
                by_room[room] = deque()
            by_room[room].append(row)
    return rows


def pack(examples: Sequence[Example], cutoff_len: int) -> List[PackedRow]:
    out = []
    for members in pack_plan([len(e.input_ids) for e in examples], cutoff_len):
        row = PackedRow([], [], [], [])
        for i in members:
            ex = examples[i]
            row.ids.append(ex.id)
            row.input_ids.extend(ex.input_ids)
            row.labels.extend([IGNORE_INDEX] + ex.labels[1:])
            row.position_ids.extend(range(len(ex.input_ids)))
        out.append(row)
    return out


def packing_efficiency(num_tokens: int, num_rows: int, cutoff_len: int) -> float:
    """Real tokens / token slots of the packed rows."""
    return num_tokens / (num_rows * cutoff_len) if num_rows else 0.0
