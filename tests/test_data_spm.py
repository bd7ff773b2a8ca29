"""SentencePiece-style ("▁") tokenizers, built here with the `tokenizers` library (no download): segment-wise
encoding must not put a spurious space at the start of every reply or prompt (data/render/spm.py)."""

from __future__ import annotations

import pytest

from dsrecipes.data.render.spm import continuation_encoder
from dsrecipes.data.render.template import VICUNA_SYSTEM
from dsrecipes.data.render.tokenize import IGNORE_INDEX, Encoder
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

CORPUS = ["Hello world, how are you? I am fine, thank you.", "USER: ASSISTANT: ### User:\n\nHuman: Assistant:",
          VICUNA_SYSTEM] * 20

CONV = Conversation("c", [Turn(Role.user, "how are you"), Turn(Role.assistant, "I am fine"),
                          Turn(Role.user, "Hello world"), Turn(Role.assistant, "Hello, thank you")])


def spm_tokenizer(style: str):
    """A Llama-2 / Mistral-v1 style tokenizer: BPE with byte fallback and a "▁" start marker, in one of the
    layouts found in the wild."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    if style == "legacy":  # Llama-2's tokenizer.json: a Prepend("▁") normalizer, no pre-tokenizer
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:  # Metaspace pre-tokenizer, prepend_scheme "always" (Mistral v1) or "first" (Llama-2, legacy=False)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=style)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=style)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"])
    if style == "legacy":
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("▁"), "merged_with_next")  # only to train word pieces
        tok.train_from_iterator(CORPUS, trainer)
        tok.pre_tokenizer = None
    else:
        tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def spelled(tok, ids) -> str:
    return "".join(tok.convert_ids_to_tokens(ids)).replace("▁", " ")


def trained_texts(tok, ex):
    """The text of each run of trained tokens, spelled from its tokens ("▁" is a space; nothing stripped)."""
    runs, current = [], []
    for tid, label in zip(ex.input_ids, ex.labels):
        if label != IGNORE_INDEX:
            current.append(tid)
        elif current:
            runs.append(current)
            current = []
    runs += [current] if current else []
    return [spelled(tok, r) for r in runs]


@pytest.mark.parametrize("style", ["always", "first", "legacy"])
@pytest.mark.parametrize("template", ["vicuna", "human_assistant", "plain"])
def test_replies_and_prompts_have_no_spurious_spaces(make_cfg, style, template):
    tok = spm_tokenizer(style)
    assert continuation_encoder(tok.backend_tokenizer) is not None
    enc = Encoder(tok, make_cfg(f"template={template}"))
    ex = enc.encode(CONV)
    # the one space after "ASSISTANT:" is the reply's first token ("▁I"), never a separate or doubled one
    assert trained_texts(tok, ex) == [" I am fine</s>", " Hello, thank you</s>"]
    segments = [s.text for s in enc.render(CONV)]
    # The first segment is tokenized as at inference (start marker included); every later one adds nothing.
    want = spelled(tok, tok(segments[0], add_special_tokens=False)["input_ids"]) + "".join(segments[1:])
    if template == "plain":
        want = want[: want.rindex("</s>") + len("</s>")]  # text after the last reply is never kept
    assert spelled(tok, ex.input_ids) == want
    assert "<unk>" not in want and "<0x" not in want


def test_the_first_segment_keeps_the_start_marker_as_at_inference(make_cfg):
    tok = spm_tokenizer("always")
    enc = Encoder(tok, make_cfg("template=vicuna"))
    ex = enc.encode(CONV)
    prompt = tok.bos_token + "A chat between"
    inference = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ex.input_ids[: len(inference)] == inference
    assert tok.convert_ids_to_tokens(ex.input_ids[1]).startswith("▁")


def test_byte_level_tokenizers_are_encoded_as_before(make_cfg):
    from dsrecipes.core.tokenizer import load_tokenizer

    cfg = make_cfg()
    tok = load_tokenizer(cfg)
    assert continuation_encoder(tok.backend_tokenizer) is None
    texts = ["Hello", " world", "<|im_start|>assistant\n"]
    assert Encoder(tok, cfg).encode_texts(texts, continuation=True) == [tok(t, add_special_tokens=False)["input_ids"]
                                                                         for t in texts]
