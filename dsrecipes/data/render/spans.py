"""Token spans of rendered segments from ONE tokenization of the whole conversation text (Encoder's fast path).

A conversation renders to segments (template.py): prompt, reply, prompt, reply, ... Tokenizing the joined text once,
the way the conversation reads at inference, and cutting the tokens at the segment borders costs about half as
much as tokenizing every segment on its own (fewer, longer strings per Rust call). The result is used for a
conversation only when both checks pass; otherwise `FullText.spans` returns None for it and the Encoder tokenizes
that conversation per segment (each prompt and each reply alone, the previous rule):

1. Every border falls between two tokens (no token straddles it). Fails e.g. where a prompt ends in a space and the
   reply starts with a word: byte-level BPE glues them into one " word" token (vicuna, plain, human_assistant with
   a GPT-2 style tokenizer; the Encoder's probe then skips this path for the whole template).
2. The tokens of every prompt, up to the reply that follows it, are exactly those of that prompt tokenized alone,
   which is what inference feeds the model (the text up to the generation prompt as one string). Only the piece
   after the prompt's last added token (e.g. "assistant\\n" after "<|im_start|>") can differ, through look-ahead
   into the reply (GPT-2's `\\s+(?!\\S)` splits "\\n\\n" before a word differently than at the end of a string); it
   is compared with a cached tokenization of that added token + piece.

Where the result can still differ from per-segment encoding (labels are exact either way: trained tokens always
decode to exactly the reply text and its end-of-turn token):
- Pre-tokenizers that treat the start of a string specially (SentencePiece/Metaspace "▁" prefix, ByteLevel
  add_prefix_space): per segment every reply starts with a spurious space; in one text it does not. One text is what
  the tokenizer does with the conversation (and what inference sees for earlier turns).
- A reply that does not end in an added token (end-of-turn as plain text): its last tokens may be cut differently
  with look-ahead into the following text. Generation emits the reply token by token, so either tokenization of the
  reply can be produced; the prompt side is the one inference fixes, and check 2 pins it.
- A border inside one pre-token where BPE happens to split exactly there (both sides then start/end mid-word).

Finding the borders: byte-level BPE tokenizers without a normalizer (GPT-2, Llama-3, SmolLM style) spell every
token as bytes of the text, so a table of token byte lengths locates every border without the offsets Rust would
otherwise compute (`encode_batch_fast`, ~20% cheaper than `encode_batch`); a conversation whose token bytes do not
add up to its text's is handed back (None). Other tokenizers use the character offsets of `encode_batch`.
"""

from __future__ import annotations

import json
from itertools import accumulate, chain
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
from tokenizers import Tokenizer, pre_tokenizers

Spans = Tuple[np.ndarray, List[int]]  # (token ids, int32; token index where each segment starts, plus the end)

_CACHE_LIMIT = 4096  # distinct prompt tails remembered (templates have a handful: one per role header)
_SPLITTING = {"Split", "Digits", "Punctuation"}  # pre-tokenizers that only cut the text (and do not drop any of it)


class FullText:
    """Tokenizes whole conversations and maps segment borders to token indices."""

    def __init__(self, backend: Any):
        # A private copy without post-processor: with add_special_tokens=False it adds no tokens, but ByteLevel's
        # `trim_offsets` would move offsets off leading spaces and hide a token straddling a border.
        self._tok = Tokenizer.from_str(backend.to_str())
        self._tok.post_processor = None
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._byte_len = _token_byte_lengths(self._tok)
        self._refs: Dict[str, List[int]] = {}

    def spans(self, segments: Sequence[Sequence[str]], replies: Sequence[Sequence[int]]) -> List[Optional[Spans]]:
        """`segments[i]`: the segment texts of conversation i; `replies[i]`: indices of its segments that are
        replies (checked against the prompt before them). None where a check fails."""
        texts = ["".join(segs) for segs in segments]
        if self._byte_len is not None:
            out = self._by_bytes(texts, segments)
        else:
            out = self._by_offsets(texts, segments)
        checks: List[Tuple[int, str, int, int]] = []  # (conversation, reference text, first token, end token)
        for i, span in enumerate(out):
            if span is not None:
                checks += [(i, *ref) for ref in self._prompt_refs(span, texts[i], segments[i], replies[i])]
        uncached = self._references(key for _, key, _, _ in checks)
        for i, key, first, end in checks:
            ref = self._refs[key] if key in self._refs else uncached[key]
            if out[i] is not None and out[i][0][first:end].tolist() != ref:
                out[i] = None
        return out

    def _by_offsets(self, texts: List[str], segments: Sequence[Sequence[str]]) -> List[Optional[Spans]]:
        out: List[Optional[Spans]] = []
        for enc, text, segs in zip(self._tok.encode_batch(texts, add_special_tokens=False), texts, segments):
            ids = np.array(enc.ids, dtype=np.int32)
            starts = [0]
            pos = 0
            for seg in segs[:-1]:
                pos += len(seg)
                k = _token_at(enc, pos, len(text), len(ids))
                if k is None:
                    break
                starts.append(k)
            else:
                starts.append(len(ids))
                out.append((ids, starts))
                continue
            out.append(None)
        return out

    def _by_bytes(self, texts: List[str], segments: Sequence[Sequence[str]]) -> List[Optional[Spans]]:
        encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        counts = np.fromiter(map(len, encodings), dtype=np.int64, count=len(encodings))
        flat = np.fromiter(chain.from_iterable(e.ids for e in encodings), dtype=np.int32, count=int(counts.sum()))
        del encodings
        if not len(flat):
            return [None] * len(texts)
        ends = np.cumsum(self._byte_len[flat])  # byte end of every token, over the whole batch
        first_tok = np.cumsum(counts) - counts
        base = np.concatenate([[0], ends])[first_tok]  # byte start of each conversation
        border_list: List[int] = []  # byte position of every border, conversation by conversation
        n_borders: List[int] = []
        text_bytes: List[int] = []
        for segs in segments:
            sizes = list(accumulate(len(t) if t.isascii() else len(t.encode("utf-8")) for t in segs))
            border_list += sizes[:-1]
            n_borders.append(max(len(sizes) - 1, 0))
            text_bytes.append(sizes[-1] if sizes else 0)
        reps = np.array(n_borders, dtype=np.int64)
        borders = np.array(border_list, dtype=np.int64) + np.repeat(base, reps)
        at = np.searchsorted(ends, borders)  # the first token ending at or after the border
        aligned = (ends[np.minimum(at, len(ends) - 1)] == borders).tolist()
        local = (at + 1 - np.repeat(first_tok, reps)).tolist()
        totals = (np.concatenate([[0], ends])[first_tok + counts] - base).tolist()
        out: List[Optional[Spans]] = []
        j = 0
        for i, (start, count) in enumerate(zip(first_tok.tolist(), counts.tolist())):
            n = n_borders[i]
            if totals[i] != text_bytes[i] or not all(aligned[j: j + n]):
                out.append(None)  # tokens are not the text's bytes (or a token straddles a border)
            else:
                out.append((flat[start: start + count], [0] + local[j: j + n] + [count]))
            j += n
        return out

    def _prompt_refs(self, span: Spans, text: str, segs: Sequence[str], replies: Sequence[int]):
        """(reference text, token range) for the tokens of each prompt piece before a reply."""
        ids, starts = span
        refs = []
        for j in replies:
            if j == 0:
                continue
            end = starts[j]
            h = end - 1
            while h >= 0 and int(ids[h]) not in self._added:
                h -= 1
            if h == end - 1:
                continue  # the prompt ends in an added token: a hard border
            if h < 0:  # no added token before: the whole prompt, from the start of the text
                refs.append((text[: sum(len(s) for s in segs[:j])], 0, end))
                continue
            # The last added token before the border is the last occurrence of its text (every occurrence of an
            # added token's text is that token; if not, e.g. single_word tokens, the comparison fails: safe).
            content, prompt = self._added[int(ids[h])], segs[j - 1]
            cut = prompt.rfind(content)
            if cut < 0:  # the added token lies in an earlier segment
                border = sum(len(s) for s in segs[:j])
                refs.append((text[text.rfind(content, 0, border): border], h, end))
            else:
                refs.append((prompt[cut:], h, end))
        return refs

    def _references(self, keys: Any) -> Dict[str, List[int]]:
        """Tokenizes the reference texts not cached yet (one batch); short ones are cached, the rest returned."""
        todo = list(dict.fromkeys(k for k in keys if k not in self._refs))
        encoded = [e.ids for e in self._tok.encode_batch_fast(todo, add_special_tokens=False)] if todo else []
        uncached: Dict[str, List[int]] = {}
        for key, ids in zip(todo, encoded):
            if len(key) <= 256 and len(self._refs) < _CACHE_LIMIT:
                self._refs[key] = ids
            else:
                uncached[key] = ids
        return uncached


def _token_at(enc: Any, pos: int, n_chars: int, n_tokens: int) -> Optional[int]:
    """Index of the token that starts at character `pos`, or None when a token straddles it (or the character
    belongs to no token, e.g. removed by a normalizer)."""
    if pos >= n_chars:
        k = n_tokens
    else:
        k = enc.char_to_token(pos)
        if k is None or enc.token_to_chars(k)[0] != pos:
            return None
    if k > 0 and enc.token_to_chars(k - 1)[1] > pos:
        return None
    return k


def _token_byte_lengths(tok: Any) -> Optional[np.ndarray]:
    """Bytes of text each token id stands for, when every token is spelled in bytes of the text (byte-level BPE, no
    normalizer, pre-tokenizers that only cut); None otherwise."""

    spec = json.loads(tok.to_str())
    if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
        return None
    if not _byte_level_only(spec.get("pre_tokenizer")):
        return None
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    size = tok.get_vocab_size(with_added_tokens=True)
    lengths = np.zeros(size, dtype=np.int64)
    added = tok.get_added_tokens_decoder()
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        if i in added:
            a = added[i]
            if a.lstrip or a.rstrip or a.normalized:
                return None  # such tokens swallow or rewrite neighbouring text
            lengths[i] = len(a.content.encode("utf-8"))
        elif set(token) <= alphabet:
            lengths[i] = len(token)  # one alphabet character per byte
        else:
            return None
    return lengths


def _byte_level_only(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    kind = node.get("type")
    if kind == "Sequence":
        parts = node.get("pretokenizers") or []
        return bool(parts) and any(p.get("type") == "ByteLevel" for p in parts) and all(
            p.get("type") == "ByteLevel" and _byte_level_only(p) or p.get("type") in _SPLITTING
            and p.get("behavior", "Isolated") != "Removed" for p in parts)
    return kind == "ByteLevel" and not node.get("add_prefix_space", False)
