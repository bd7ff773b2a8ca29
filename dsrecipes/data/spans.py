"""Token spans of rendered segments from ONE tokenization of the whole conversation text (Encoder's fast path).

A conversation renders to segments (template.py): prompt, reply, prompt, reply, ... Tokenizing the joined text once,
the way the conversation reads at inference, and cutting the tokens at the segment borders by character offsets
costs about half as much as tokenizing every segment on its own (fewer, longer strings per Rust call). The result
is used for a conversation only when both checks pass; otherwise `FullText.spans` returns None for it and the
Encoder tokenizes that conversation per segment (each prompt and each reply alone, the previous rule):

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
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

Spans = Tuple[List[int], List[int]]  # (token ids, token index where each segment starts, plus the end)

_CACHE_LIMIT = 4096  # distinct prompt tails remembered (templates have a handful: one per role header)


class FullText:
    """Tokenizes whole conversations and maps segment borders (character positions) to token indices."""

    def __init__(self, backend: Any):
        from tokenizers import Tokenizer

        # A private copy without post-processor: with add_special_tokens=False it adds no tokens, but ByteLevel's
        # `trim_offsets` would move offsets off leading spaces and hide a token straddling a border.
        self._tok = Tokenizer.from_str(backend.to_str())
        self._tok.post_processor = None
        self._added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        self._refs: Dict[str, List[int]] = {}

    def spans(self, texts: Sequence[str], borders: Sequence[Sequence[int]],
              replies: Sequence[Sequence[int]]) -> List[Optional[Spans]]:
        """`borders[i]`: character positions where segments 1.. of text i start; `replies[i]`: indices of segments
        that are replies (checked against the prompt before them). None where a check fails."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        out: List[Optional[Spans]] = []
        checks: List[Tuple[int, str, int, int]] = []  # (conversation, reference text, first token, end token)
        for i, (enc, text) in enumerate(zip(encodings, texts)):
            ids = enc.ids
            starts = _token_starts(enc, borders[i], len(text), len(ids))
            out.append(None if starts is None else (ids, starts))
            if starts is not None:
                checks += [(i, *ref) for ref in self._prompt_refs(enc, ids, text, starts, borders[i], replies[i])]
        uncached = self._references(key for _, key, _, _ in checks)
        for i, key, first, end in checks:
            ref = self._refs[key] if key in self._refs else uncached[key]
            if out[i] is not None and out[i][0][first:end] != ref:
                out[i] = None
        return out

    def _prompt_refs(self, enc: Any, ids: List[int], text: str, starts: List[int], borders: Sequence[int],
                     replies: Sequence[int]) -> List[Tuple[str, int, int]]:
        """(reference text, token range) for the tokens of each prompt piece before a reply."""
        refs = []
        for j in replies:
            if j == 0:
                continue
            end, b = starts[j], borders[j - 1]
            h = end - 1
            while h >= 0 and ids[h] not in self._added:
                h -= 1
            if h == end - 1:
                continue  # the prompt ends in an added token: a hard border
            if h < 0:  # no added token before: the whole prompt, from the start of the text
                refs.append((text[:b], 0, end))
            else:
                refs.append((self._added[ids[h]] + text[enc.token_to_chars(h)[1]: b], h, end))
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


def _token_starts(enc: Any, borders: Sequence[int], n_chars: int, n_tokens: int) -> Optional[List[int]]:
    """Token index where each segment starts ([0, ..., n_tokens]), or None when a token straddles a border (or a
    border character belongs to no token, e.g. removed by a normalizer)."""
    starts = [0]
    for b in borders:
        if b >= n_chars:
            k = n_tokens
        else:
            k = enc.char_to_token(b)
            if k is None or enc.token_to_chars(k)[0] != b:
                return None
        if k > 0 and enc.token_to_chars(k - 1)[1] > b:
            return None
        starts.append(k)
    starts.append(n_tokens)
    return starts
