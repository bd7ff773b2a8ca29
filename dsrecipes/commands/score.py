"""`dsrecipes score EXPORT --pairs FILE [--out FILE]`: a reward model (an `objective=reward` export, or any Hugging
Face sequence-classification directory with one label) scores preference pairs.

Pairs are read like training pairs (data/sources/preference.py), per line in either format: TRL's `prompt` /
`chosen` / `rejected` message lists, or LLaMA-Factory's `conversations` + `chosen` + `rejected`. Each side is the
prompt plus that answer rendered with the directory's chat template (an export's is its training template), ending
with the answer's end-of-turn token as in training, and scored at its last non-pad token as transformers' sequence
classification does. Printed: pairs, pairwise accuracy
(share with reward(chosen) > reward(rejected)) and mean margin; written (--out, default FILE.rewards.jsonl, never
over an existing file): one JSON line per pair with both rewards. Every failure (a directory that is not a model, one
that needs its own code, a malformed pair named by file:line) is one message and exit 2, with nothing written. A
dsrecipes export is checked before anything of it is loaded as chat and prompt-eval check it (serve/inference.py
check_loadable): signed by this user, or trusted with --trust-checkpoint PATH, and its files as written.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Dict, List, Tuple

from dsrecipes.boundary.chat_sandbox import TemplateRaised, render_many
from dsrecipes.boundary.trust import FLAG, TRUST_HELP, trust
from dsrecipes.commands.args import existing_path, parse
from dsrecipes.core.errors import UserError, no_custom_code
from dsrecipes.core.export_dir import EXPORT_MARKER, merge_first
from dsrecipes.core.fileio import Unreadable, atomic_write_text, json_text
from dsrecipes.core.schema import ColumnsConfig, DatasetFormat, SourceConfig
from dsrecipes.core.tokenizer import NO_DIRECTORY_CODE, custom_code_problems, not_a_scorer, read_json
from dsrecipes.data.sources.badrows import BadRow
from dsrecipes.data.sources.messages import messages_for
from dsrecipes.data.sources.preference import Pair, parse_pair_item
from dsrecipes.data.sources.sharegpt import role_table
from dsrecipes.run.preflight import TOKENIZER_READS, WEIGHT_PATTERNS, irregular_files, writable_dir

BATCH = 8  # sequences per forward


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsrecipes score", description="Score preference pairs with a reward model: "
                                     "pairwise accuracy, mean margin, and per-pair rewards as JSONL.")
    parser.add_argument("export", help="a sequence-classification model directory (an objective=reward export)")
    parser.add_argument("--pairs", required=True, help="JSONL pairs (TRL prompt/chosen/rejected or LLaMA-Factory "
                        "conversations/chosen/rejected)")
    parser.add_argument("--out", default=None, help="per-pair rewards JSONL to write (default: PAIRS.rewards.jsonl); "
                        "must not exist")
    parser.add_argument(FLAG, action="append", default=[], type=existing_path, metavar="PATH", help=TRUST_HELP)
    args = parse(parser, argv)
    trust(args.trust_checkpoint)
    model_dir, pairs_path = Path(args.export).expanduser(), Path(args.pairs).expanduser()
    out = Path(args.out).expanduser() if args.out else pairs_path.with_suffix(".rewards.jsonl")
    check_model_dir(model_dir)
    if out.exists() or out.is_symlink():  # a dangling link too: writing would replace the user's link
        raise UserError(f"--out: {out} exists{' (a symbolic link)' if out.is_symlink() else ''}; dsrecipes score "
                        "writes a new file (give another --out)")
    for problem in writable_dir("--out", out.parent):  # below a file or a dangling link: refused before scoring
        raise UserError(problem)
    pairs = read_pairs(pairs_path)
    model, tokenizer = load_scorer(model_dir, retry=f"dsrecipes score {args.export} --pairs {args.pairs}")
    rows = score_pairs(model, tokenizer, pairs, end_of_turn(model_dir))
    atomic_write_text(out, "".join(json_text(r, indent=None) for r in rows))
    n = len(rows)
    accuracy = sum(r["correct"] for r in rows) / n
    margin = sum(r["margin"] for r in rows) / n
    print(f"pairs {n}  reward_accuracy {accuracy:.4f}  reward_margin {margin:.4f}  rewards -> {out}")
    return 0


def check_model_dir(path: Path) -> None:
    """The checks of any model directory: a config, safetensors weights only, no code of its own."""
    from dsrecipes.modeling.model import pickled_weights_problem  # lazy: torch

    if not path.is_dir() or not (path / "config.json").is_file():
        export = path / "export"  # a run directory, as chat and prompt-eval take: its export is the scorer
        where = f"; its export is {export}" if (export / "config.json").is_file() else ""
        raise UserError(f"{path}: not a model directory (no config.json); give an objective=reward export{where}"
                        f"{merge_first(path) or merge_first(export)}")
    for problem in irregular_files("EXPORT", path, ("config.json", *WEIGHT_PATTERNS, *TOKENIZER_READS)):
        raise UserError(problem)  # a FIFO there would block the reads below for ever
    problem = pickled_weights_problem(path, "EXPORT")
    if problem is None and next(path.glob("*.safetensors"), None) is None:
        problem = f"{path}: no *.safetensors weights (an adapter-only export needs --lora merged to be scored)"
    if problem is not None:
        raise UserError(problem)
    for problem in custom_code_problems("EXPORT", path):
        raise UserError(problem)
    found = not_a_scorer(path / "config.json")  # before loading: transformers would first print its load report
    if found and found.generator:  # an SFT/DPO/ORPO/GRPO export: no score head (its config's default of 2 labels says nothing)
        raise UserError(f"{path}: a text-generating model ({found.generator}), not a reward model; dsrecipes score "
                        "takes the export of an objective=reward run (a scalar score head)")
    if found:
        raise UserError(f"{path}: a reward model has one label (a scalar score), this one has {found.labels} "
                        "(config.json; an objective=reward export has one)")


def read_pairs(path: Path) -> List[Tuple[int, Pair]]:
    """(line, pair) of every non-empty line; a malformed one is one message naming file:line."""
    if not path.is_file():
        raise UserError(f"--pairs: {path} is not a file")
    openai = ColumnsConfig(messages="messages", role="role", content="content")  # as dataset=openai_messages
    sources = {fmt: SourceConfig(name="pairs", paths=[str(path)], format=fmt, ranking=True, columns=cols)
               for fmt, cols in ((DatasetFormat.openai, openai), (DatasetFormat.sharegpt, ColumnsConfig()))}
    roles = {fmt: role_table(src) for fmt, src in sources.items()}
    out = []
    with open(path, "rb") as f:
        for loc, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            fmt = DatasetFormat.openai if b'"prompt"' in raw else DatasetFormat.sharegpt
            try:
                out.append((loc, parse_pair_item(raw.rstrip(b"\r\n"), str(path), loc, sources[fmt], roles[fmt])))
            except BadRow as exc:
                raise UserError(f"{path}:{loc}: {exc}" + (f"; {exc.advice}" if exc.advice else "")) from None
    if not out:
        raise UserError(f"--pairs: {path} holds no pairs")
    return out


def load_scorer(path: Path, retry: str) -> Tuple[Any, Any]:
    """The model and tokenizer of `path`, once it passed the check chat and prompt-eval make (a dsrecipes export:
    signed by this user or trusted with --trust-checkpoint, its files as written); `retry`: the command a refusal
    names."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from dsrecipes.serve.inference import check_loadable, loading  # lazy: torch

    check_loadable(path, retry, scorer=True)
    with no_custom_code("EXPORT", str(path)), loading(path, "a sequence-classification model"):
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        model = AutoModelForSequenceClassification.from_pretrained(str(path), use_safetensors=True,
                                                                   **NO_DIRECTORY_CODE)
    if model.config.num_labels != 1:
        raise UserError(f"{path}: a reward model has one label (a scalar score), this one has {model.config.num_labels}")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer


def pair_texts(tokenizer: Any, loc: int, pair: Pair) -> Tuple[str, str]:
    """prompt + each answer, rendered as training renders it for this chat template (data/sources/messages.py)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("EXPORT: the tokenizer has no chat template to render pairs with (a dsrecipes export has one)")
    messages, tools = messages_for(pair.prompt, tokenizer.chat_template)
    try:  # in the sandbox's child, under its time, memory and output limits (a limit: TemplateRefused, exit 2)
        return tuple(render_many(tokenizer, [(messages + [{"role": "assistant", "content": answer}], False)
                                             for answer in (pair.chosen, pair.rejected)], tools))
    except TemplateRaised as exc:  # the template's own refusal (raise_exception) or a render error
        raise UserError(f"{pair.prompt.path}:{loc}: the chat template cannot render this pair "
                        f"({(exc.detail or str(exc)).splitlines()[0][:200]})") from None


def end_of_turn(path: Path) -> List[int]:
    """The end-of-turn ids a dsrecipes export records (dsrecipes_export.json): a trained sequence ends with the
    answer's end-of-turn token, so what a chat template renders after it (chatml's newline) is cut off, else the
    score would be read at another token than training read it. [] for a directory from elsewhere."""
    try:
        ids = read_json(path / EXPORT_MARKER).get("end_of_turn_ids") or []  # bounded: the directory is anyone's
    except Unreadable as exc:  # nested brackets (json's RecursionError), a FIFO, a giant file
        raise UserError(f"{path / EXPORT_MARKER}: unreadable ({exc}); nothing was scored") from None
    except (OSError, ValueError, AttributeError):
        return []
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)] if isinstance(ids, list) else []


def encode(tokenizer: Any, text: str, stops: List[int]) -> List[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    last = max((i for i, t in enumerate(ids) if t in stops), default=len(ids) - 1)
    return ids[:last + 1]


def score_pairs(model: Any, tokenizer: Any, pairs: List[Tuple[int, Pair]], stops: List[int]) -> List[Dict[str, Any]]:
    import torch

    seqs = [encode(tokenizer, text, stops) for loc, pair in pairs for text in pair_texts(tokenizer, loc, pair)]
    scores: List[float] = []
    with torch.no_grad():
        for i in range(0, len(seqs), BATCH):
            chunk = seqs[i:i + BATCH]
            width = max(len(s) for s in chunk)
            ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, seq in enumerate(chunk):
                ids[row, :len(seq)], mask[row, :len(seq)] = torch.tensor(seq), 1
            scores += model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()
    return [{"line": loc, "id": pair.prompt.id, "chosen_reward": c, "rejected_reward": r, "margin": c - r,
             "correct": c > r} for (loc, pair), c, r in zip(pairs, scores[0::2], scores[1::2])]
