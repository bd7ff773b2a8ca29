"""SentencePiece-style tokenizers and segment-wise tokenization: no word-start marker in the middle of a text.

Llama-2 / Mistral-v1 style tokenizers mark the start of a text with "▁" (a space): a `Metaspace` pre-tokenizer with
`prepend_scheme` "always"/"first", or a `Prepend("▁")` normalizer (the legacy Llama layout). data/render/tokenize.py encodes
each template segment on its own (so a trained reply never shares a token with its prompt), and such a tokenizer then
puts "▁" in front of every segment: "ASSISTANT: " + "Hello</s>" became [..., ":", "▁"] + ["▁Hello", "</s>"], a
spurious space at the start of every reply (and of every prompt after the first). At inference the rendered prompt
is tokenized once, with the marker only at its start, and the model continues right after it.

`continuation_encoder(backend)` returns the batch encoder of a copy of the tokenizer with that prepending switched
off (`prepend_scheme: never`, the `Prepend("▁")` normalizer dropped); the Encoder uses it for every segment except
the first of a sample, so a sample's tokens decode to exactly the rendered text. Tokenizers without a prepended
marker (byte-level BPE like GPT-2/Llama-3/Qwen/SmolLM) get None and are encoded as before.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, Optional

from tokenizers import Tokenizer

MARKER = "\u2581"  # "▁", SentencePiece's word-start / space symbol


def continuation_encoder(backend: Any) -> Optional[Callable[..., Any]]:
    """`encode_batch` of a copy of `backend` (a `tokenizers.Tokenizer`) that adds no "▁" at the start of a text, or
    None when `backend` adds none."""

    spec = json.loads(backend.to_str())
    changed = _no_prepend_pre_tokenizer(spec.get("pre_tokenizer"))
    normalizer, dropped = _without_prepend(spec.get("normalizer"))
    if not (changed or dropped):
        return None
    spec["normalizer"] = normalizer
    copy = Tokenizer.from_str(json.dumps(spec))
    return getattr(copy, "encode_batch_fast", copy.encode_batch)


def _no_prepend_pre_tokenizer(node: Optional[Dict[str, Any]]) -> bool:
    """Switch off Metaspace's prepending in place (nested Sequences included); True when something changed."""
    if not node:
        return False
    if node.get("type") == "Sequence":
        return any([_no_prepend_pre_tokenizer(child) for child in node.get("pretokenizers", [])])
    if node.get("type") != "Metaspace":
        return False
    changed = node.get("prepend_scheme", "always") != "never" or node.get("add_prefix_space") is True
    node["prepend_scheme"] = "never"
    if "add_prefix_space" in node:  # tokenizers < 0.14 spelling
        node["add_prefix_space"] = False
    return changed


def _without_prepend(node: Optional[Dict[str, Any]]) -> tuple:
    """(normalizer without `Prepend("▁")`, whether one was dropped)."""
    if not node:
        return node, False
    if node.get("type") == "Prepend" and node.get("prepend") == MARKER:
        return None, True
    if node.get("type") == "Sequence":
        kept = [n for n in node.get("normalizers", []) if not (n.get("type") == "Prepend" and n.get("prepend") == MARKER)]
        if len(kept) != len(node.get("normalizers", [])):
            return dict(node, normalizers=kept), True
    return node, False
