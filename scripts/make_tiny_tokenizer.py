"""Build the bundled tiny tokenizer: dsrecipes/assets/tiny_tokenizer/ (a Hugging Face PreTrainedTokenizerFast dir).

A byte-level BPE (GPT-2 style: every UTF-8 string round-trips, Chinese included) trained on the bundled sample data,
with the special tokens of every built-in chat template kept whole:

    <|endoftext|> (pad + eos), <|im_start|> <|im_end|> (chatml), <|begin_of_text|> <|start_header_id|>
    <|end_header_id|> <|eot_id|> (llama3), <s> </s> (vicuna)

`tokenizer_config.json` carries a ChatML `chat_template` handling system / user / assistant / tool turns, assistant
`tool_calls` and a `tools` list; it renders exactly what `template=chatml` renders, so `template=tokenizer` and
`template=chatml` agree on this tokenizer. Load it offline with `AutoTokenizer.from_pretrained(dir)`.

    python scripts/make_tiny_tokenizer.py [--vocab 3000] [--data dsrecipes/assets/sample_data/train.jsonl]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
OUT_DIR = ROOT / "dsrecipes" / "assets" / "tiny_tokenizer"

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
]

# ChatML, matching dsrecipes.data.render.template's `chatml` renderer (tools go into the system turn as "Tools: <json>").
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system=none) -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- if tools -%}"
    "{%- set tools_text = 'Tools: ' + (tools | tojson) -%}"
    "{%- set ns.system = (ns.system + '\\n\\n' + tools_text) if ns.system else tools_text -%}"
    "{%- endif -%}"
    "{%- if ns.system is not none -%}{{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for m in loop_messages -%}"
    "{%- if m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- for tc in m['tool_calls'] -%}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc -%}"
    "{%- set args = f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' + args + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def corpus(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            for turn in row["conversations"]:
                yield turn["value"]
            for key in ("system", "tools"):
                if key in row:
                    yield row[key]
    # Template scaffolding, so role headers become few tokens.
    for text in ["system\n", "user\n", "assistant\n", "tool\n", "<tool_call>\n", "\n</tool_call>", "Tools: ",
                 "### User: ", "### Assistant: ", "Human: ", "\n\nAssistant: ", "USER: ", " ASSISTANT: "] * 50:
        yield text


def build(data: Path, out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(data), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    # Portable tokenizer_config.json: transformers 5 writes its own class name and a separate chat_template.jinja;
    # the generic class name plus an inline chat_template also load with transformers 4.x.
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(out / "tokenizer_config.json", "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2, ensure_ascii=False)
        fh.write("\n")
    print(f"wrote {out} (vocab {tok.get_vocab_size()})")


def check(out: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template == CHAT_TEMPLATE and tok.pad_token == tok.eos_token == "<|endoftext|>"
    for text in ["Hello, world!  two  spaces\ttab\n", "法国的首都是巴黎。", "emoji 🙂 ünïcödé", "<|im_start|>user\nhi<|im_end|>"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text, (text, tok.decode(ids))
    for special in SPECIAL_TOKENS:
        assert len(tok(special, add_special_tokens=False)["input_ids"]) == 1, special


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    parser.add_argument("--vocab", type=int, default=3000)
    args = parser.parse_args()
    build(args.data, args.out, args.vocab)
    check(args.out)


if __name__ == "__main__":
    main()
