"""Conversations -> token ids + labels (batched) and truncation.

Tokenization is batched (one Rust `encode_batch` call per chunk of conversations) with `add_special_tokens=False`,
because templates spell out their own bos/eos text. Two ways, same labels (spans.py says where the tokens can
differ and why the fast one matches inference):
- one text per conversation (the fast path): the whole rendered conversation is tokenized once and cut at the
  segment borders by character offsets. Used when no token straddles a border and every prompt tokenizes as it does
  alone, which a probe at construction checks for the template, and `FullText.spans` for every conversation;
- per segment (the fallback, per conversation): every prompt and every reply tokenized on its own (identical texts,
  e.g. role headers, once), so a trained span never shares a token with the prompt. Segments after the first of a
  conversation are encoded without a SentencePiece start marker (data/render/spm.py), else a "▁" tokenizer (Llama-2 /
  Mistral-v1 style) would put a spurious space at the start of every reply.

Truncation (`data.cutoff_len`) keeps the head and cuts whole turns from the end: a sample keeps the longest run of
complete assistant/tool-call replies that fits. When not even the first reply fits (or that leaves nothing trained,
e.g. `train_on=last_assistant`), the sequence is cut at `cutoff_len` tokens, mid-reply. A sample with no trained
token left is dropped (`encode` returns None) and counted by the caller. Text after the final trained reply (a
template's trailing newline) is never kept, nor tokenized. Under `train_on=last_assistant` a conversation whose last
reply starts past `cutoff_len` (which the rule above drops) keeps its last reply instead and loses whole exchanges
from the start of its history, re-rendered as that shorter conversation (data/render/history_cut.py).

Bad rows: whatever rendering or tokenizing one conversation raises makes that conversation a bad row
(`template_error`, `too_deep`, `tokenizer_error`), never a crash of the batch it came in: a batch the tokenizer
refuses is retried conversation by conversation (one-text path) and text by text (per segment) to find the culprit.

Memory: only the first `cutoff_len` tokens of a sample are ever kept, so a text far longer than that (more than
LONG_TEXT_FACTOR characters per token of `cutoff_len`) is not tokenized whole (the Rust tokenizer needs ~150 bytes
per character of input): its first `cutoff_len + 1` tokens come from prefixes of it, accepted once two prefixes (one
twice the other) agree on them with HEAD_MARGIN tokens to spare. `cutoff_len + 1` tokens of a segment make truncation
decide exactly as the full length would (the segment overflows either way). A conversation whose text is longer
than that threshold never takes the one-text path (it would be tokenized whole): it is tokenized per segment.

Packing of the encoded samples: data/render/packing.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from dsrecipes.core.errors import ConfigError
from dsrecipes.core.schema import TrainConfig, TrainOn
from dsrecipes.data.render.history_cut import cut_history
from dsrecipes.data.render.labels import IGNORE_INDEX
from dsrecipes.data.render.spans import FullText, Spans
from dsrecipes.data.render.spm import continuation_encoder
from dsrecipes.data.render.template import Segment, check_template, render_batch
from dsrecipes.data.render.template_choice import choose_template
from dsrecipes.data.sources.badrows import BadReason, BadRow
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

LONG_TEXT_FACTOR = 8  # characters per token of cutoff_len above which a text is tokenized by its prefixes
ONE_TEXT_SEGMENTS = 16  # a conversation of at most this many long_text lengths may be tokenized as one text
HEAD_MARGIN = 64  # tokens a prefix must yield beyond cutoff_len + 1 before its head is trusted


@dataclass
class Example:
    id: str
    input_ids: List[int]
    labels: List[int]
    truncated: bool = False  # turns (or tokens) were cut to fit data.cutoff_len


@dataclass
class EncodedBatch:
    """Many conversations encoded into flat arrays: sample i's tokens follow sample i-1's, `lengths[i]` of them."""

    input_ids: np.ndarray  # int32
    labels: np.ndarray  # int32, IGNORE_INDEX where not trained
    lengths: np.ndarray  # int64; 0: no example (a bad row, or nothing trained left after truncation)
    truncated: np.ndarray  # bool
    bad: List[Tuple[int, BadRow]]  # (position in the batch, why) when the template refused the conversation
    per_segment: int = 0  # conversations tokenized per segment (the fallback)
    history_cut: Optional[np.ndarray] = None  # bool: kept its last reply by dropping earlier turns (history_cut.py)


# A conversation shaped like real data, to find out once whether the one-text path works for a template.
_PROBE_TURNS = [Turn(Role.user, "What is 2 + 2? 法国的首都"), Turn(Role.assistant, "2 + 2 = 4. 巴黎"),
                Turn(Role.user, "Thanks!"), Turn(Role.assistant, "You are welcome.")]
_PROBE = [Conversation("probe", _PROBE_TURNS, system="Be brief."), Conversation("probe", _PROBE_TURNS)]


class Encoder:
    """Renders with `cfg.template`, labels per `cfg.data.train_on`, truncates to `cfg.data.cutoff_len`.

    `full_text`: None probes whether one-text tokenization works for this template and tokenizer; False forces
    per-segment tokenization (tests and benchmarks compare the two).
    """

    def __init__(self, tokenizer: Any, cfg: TrainConfig, full_text: Optional[bool] = None):
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
        self._full = FullText(backend) if full_text is not False else None
        if self._full is not None and full_text is None and not self._probe():
            self._full = None  # e.g. "ASSISTANT: " + "word": every reply would straddle; don't try each time

    @property
    def full_text(self) -> bool:
        return self._full is not None

    def _probe(self) -> bool:
        """Whether one-text tokenization works for this template: on a conversation shaped like real data, without
        its system prompt if the template refuses one (a chat_template may); no when it refuses both."""
        for conv in _PROBE:
            try:
                return all(s is not None for s in self._spans([self.render(conv)]))
            except BadRow:
                continue
        return False

    def render(self, conv: Conversation) -> List[Segment]:
        """Segments of one conversation, or BadRow: a template is code working on untrusted rows, so anything it
        raises belongs to this row."""
        got = self.render_all([conv])[0]
        if isinstance(got, BadRow):
            raise got
        return got

    def render_all(self, convs: Sequence[Conversation]) -> List[Union[List[Segment], BadRow]]:
        """`render` of each conversation (its segments or its BadRow), a model's own template in one exchange with
        its sandbox per chunk (template.render_batch); TemplateRefused (the template is hostile, not a row) is raised."""
        return [got if isinstance(got, list) else _row_problem(got)
                for got in render_batch(convs, self.template, self.tokenizer, self.train_on)]

    def encode(self, conv: Conversation) -> Optional[Example]:
        return self.encode_batch([conv])[0]

    def encode_batch(self, convs: Sequence[Conversation],
                     errors: Optional[List[Tuple[Conversation, BadRow]]] = None) -> List[Optional[Example]]:
        """One Example per conversation (None: nothing trained left after truncation, or a bad row when `errors`
        collects `(conv, BadRow)` instead of raising)."""
        batch = self.encode_arrays(convs)
        if errors is None and batch.bad:
            raise batch.bad[0][1]
        if errors is not None:
            errors += [(convs[i], bad) for i, bad in batch.bad]
        ends = np.cumsum(batch.lengths)
        out: List[Optional[Example]] = []
        for i, conv in enumerate(convs):
            n = int(batch.lengths[i])
            if not n:
                out.append(None)
                continue
            a, b = int(ends[i]) - n, int(ends[i])
            out.append(Example(conv.id, batch.input_ids[a:b].tolist(), batch.labels[a:b].tolist(),
                               bool(batch.truncated[i])))
        return out

    def encode_arrays(self, convs: Sequence[Conversation]) -> EncodedBatch:
        """The batch as flat arrays (what `prepare` stores); conversations the template or the tokenizer refuses are
        collected in `bad` (in batch order), never raised. Under `train_on=last_assistant` a conversation that would
        lose its last reply to the cutoff drops earlier turns instead (data/render/history_cut.py)."""
        rendered, spans, bad, fallback = self.render_spans(convs)
        cut = np.zeros(len(convs), dtype=bool)
        if self.train_on is TrainOn.last_assistant:
            cut = cut_history(self, convs, rendered, spans)
        batch = self._assemble(rendered, spans)
        batch.truncated |= cut
        batch.history_cut = cut
        batch.bad = sorted(bad, key=lambda b: b[0])
        batch.per_segment = fallback
        return batch

    def render_spans(self, convs: Sequence[Conversation]
                     ) -> Tuple[List[Optional[List[Segment]]], List[Optional[Spans]], List[Tuple[int, BadRow]], int]:
        """(segments through the last reply, token spans, (position, BadRow) of refused conversations, conversations
        tokenized per segment) of each conversation: everything but truncation."""
        rendered: List[Optional[List[Segment]]] = []
        bad: List[Tuple[int, BadRow]] = []
        for i, got in enumerate(self.render_all(convs)):
            if isinstance(got, BadRow):
                bad.append((i, got))
            rendered.append(None if isinstance(got, BadRow) else _through_last_turn(got))
        todo = [i for i, segs in enumerate(rendered) if segs]
        spans: List[Optional[Spans]] = [None] * len(convs)
        if self._full is not None:
            # One text when no segment is long (a long one is tokenized by its head, per segment) and the whole stays
            # within ONE_TEXT_SEGMENTS long texts (~20 MB of tokenizer memory at cutoff 1024): a real chat of many
            # turns past cutoff_len still takes the fast path, and no row is ever tokenized whole beyond that.
            whole = [i for i in todo if self._one_text_fits(rendered[i])]
            for i, s in zip(whole, self._one_text([rendered[i] for i in whole])):
                spans[i] = s
        fallback = [i for i in todo if spans[i] is None]
        for i, s in zip(fallback, self._segment_spans([rendered[i] for i in fallback])):
            if isinstance(s, BadRow):
                bad.append((i, s))
            else:
                spans[i] = s
        return rendered, spans, bad, len(fallback) if self._full is not None else 0

    def _one_text_fits(self, segs: List[Segment]) -> bool:
        sizes = [len(seg.text) for seg in segs]
        return max(sizes) <= self.long_text and sum(sizes) <= ONE_TEXT_SEGMENTS * self.long_text

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
        return [self._head_ids(text, cont) if ids is None else ids for ids, (cont, text) in zip(out, keys)]

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

    def _spans(self, rendered: List[List[Segment]]) -> List[Optional[Spans]]:
        texts = [[seg.text for seg in segs] for segs in rendered]
        replies = [[j for j, seg in enumerate(segs) if seg.closes_turn] for segs in rendered]
        return self._full.spans(texts, replies)

    def _one_text(self, rendered: List[List[Segment]]) -> List[Optional[Spans]]:
        """`_spans`; where the tokenizer refuses the batch, conversation by conversation, a refused one handed to
        the per-segment path (None), which names the text it refuses."""
        try:
            return self._spans(rendered)
        except Exception:  # noqa: BLE001 - the Rust tokenizer raises TypeError, ValueError, Exception
            pass
        out: List[Optional[Spans]] = []
        for segs in rendered:
            try:
                out += self._spans([segs])
            except Exception:  # noqa: BLE001 - as above: this conversation goes per segment
                out.append(None)
        return out

    def _segment_spans(self, rendered: List[List[Segment]]) -> List[Union[Spans, BadRow]]:
        """Spans from every segment tokenized alone (identical texts once; long ones by their head), or the BadRow
        (tokenizer_error) of a conversation holding a text the tokenizer refuses."""
        # (continues the conversation, text): a SentencePiece tokenizer encodes later segments without a start marker
        keys = [[(j > 0 and self._encode_cont is not None, seg.text) for j, seg in enumerate(segs)] for segs in rendered]
        index: Dict[Tuple[bool, str], int] = {}
        for conv_keys in keys:
            for key in conv_keys:
                index.setdefault(key, len(index))
        encoded, refused = self._encode_segments(list(index))
        out: List[Union[Spans, BadRow]] = []
        for conv_keys in keys:
            failed = next((refused[index[k]] for k in conv_keys if index[k] in refused), None)
            if failed is not None:
                out.append(BadRow(BadReason.tokenizer_error, failed))
                continue
            ids: List[int] = []
            starts = [0]
            for key in conv_keys:
                ids += encoded[index[key]]
                starts.append(len(ids))
            out.append((np.array(ids, dtype=np.int32), starts))
        return out

    def _assemble(self, rendered: List[Optional[List[Segment]]], spans: List[Optional[Spans]]) -> EncodedBatch:
        n = len(rendered)
        lengths = np.zeros(n, dtype=np.int64)
        truncated = np.zeros(n, dtype=bool)
        kept_ids: List[np.ndarray] = []
        run_lengths: List[int] = []
        run_trained: List[bool] = []
        for i, (segs, span) in enumerate(zip(rendered, spans)):
            if segs is None or span is None:
                continue
            ids, starts = span
            keep, full = self.kept(segs, starts)
            if not keep:
                continue
            lengths[i], truncated[i] = keep, keep < full
            kept_ids.append(ids if keep == len(ids) else ids[:keep])
            for j, seg in enumerate(segs):
                if starts[j] >= keep:
                    break
                run_lengths.append(min(starts[j + 1], keep) - starts[j])
                run_trained.append(seg.trained)
        input_ids = np.concatenate(kept_ids) if kept_ids else np.zeros(0, dtype=np.int32)
        trained = np.repeat(np.array(run_trained, dtype=bool), np.array(run_lengths, dtype=np.int64))
        labels = np.where(trained, input_ids, np.int32(IGNORE_INDEX)).astype(np.int32)
        return EncodedBatch(input_ids, labels, lengths, truncated, [])

    def kept(self, segs: List[Segment], starts: List[int]) -> Tuple[int, int]:
        """(tokens kept, tokens of the whole sample); kept 0: nothing trained would be left."""
        turn_ends: List[int] = []
        first_trained = None
        for j, seg in enumerate(segs):
            if seg.closes_turn:
                turn_ends.append(starts[j + 1])
            if first_trained is None and seg.trained and starts[j + 1] > starts[j]:
                first_trained = starts[j]
        if not turn_ends or first_trained is None:
            return 0, 0
        full = keep = turn_ends[-1]
        if full > self.cutoff_len:
            keep = max((e for e in turn_ends if e <= self.cutoff_len), default=0)
            if keep <= first_trained:  # whole turns leave nothing trained: cut mid-reply instead
                keep = self.cutoff_len
        return (keep if keep > first_trained else 0), full


def _row_problem(exc: Exception) -> BadRow:
    """What a template raised on a row, as that row's BadRow."""
    if isinstance(exc, BadRow):
        return exc
    if isinstance(exc, RecursionError):
        return BadRow(BadReason.too_deep, "nested too deep to render")
    return BadRow(BadReason.template_error, f"{type(exc).__name__}: {exc}")


def _through_last_turn(segs: List[Segment]) -> List[Segment]:
    """Segments up to the last turn-closing one: what follows it is never kept, so it is not tokenized either."""
    for j in range(len(segs) - 1, -1, -1):
        if segs[j].closes_turn:
            return segs if j == len(segs) - 1 else segs[: j + 1]
    return []
