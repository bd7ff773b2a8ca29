"""prompt-eval (commands/prompt_eval.py): a fine-tuned model (and optionally a baseline) answer the same prompts.

In the style of DeepSpeed-Chat's step-1 `prompt_eval.py`, with the run's own template: every model is prompted
through the fine-tuned export's chat template, which is the template it was trained on (serving.py), and answers
greedily until its end-of-turn token. Any export kind works for either side (inference.py): a run directory, a
full or merged export, an adapter-only LoRA export, a base model directory. `--baseline RUN` means the run's
starting model: `RUN/export_init` for the embedded tiny model, the base model directory (`model.path`) otherwise.

What is asked: without `--prompts`, the held-out validation conversations of the run (the prompt is every turn
before the last assistant turn, the reference is that turn), so the score measures what was trained. With
`--prompts FILE`, a JSONL file, one object per line:

    {"prompt": "What is 5 + 16?", "reference": "5 + 16 = 21.", "system": "Answer briefly."}

`prompt` is required; `reference` (scored when present) and `system` are optional
(dsrecipes/assets/sample_data/prompts.jsonl is an example). Scores: exact and contains match against the reference,
character similarity to it (difflib ratio, 0..1), and the mean per-token loss of the reference as the reply (the
trained span: reply text plus end-of-turn token; lower is better). The last two move long before a small model gets
whole answers right.

`--json FILE` also writes the scores (and answers) there, marked as ours by RESULT_KEY. The path is checked before any
model is loaded (`check_json_out`): a new file in an existing or creatable directory, or a result an earlier
prompt-eval wrote; never a user's file and never inside an export or a run's checkpoints (their files are signed).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsrecipes.config.load import load_run_config
from dsrecipes.core.answers import normalize
from dsrecipes.core.errors import UserError, visible
from dsrecipes.core.export_dir import EXPORT_DIR, EXPORT_INFO, EXPORT_INIT_DIR
from dsrecipes.core.fileio import Unreadable, atomic_write_json, loads_bounded
from dsrecipes.core.paths import SAMPLE_DATA_DIR
from dsrecipes.core.rundir import CHECKPOINTS_DIR, MARKER_FILE
from dsrecipes.core.schema import BadRows
from dsrecipes.data.sources.badrows import BadRowReport
from dsrecipes.data.sources.messages import chat_messages, tool_call_text
from dsrecipes.data.sources.sharegpt import Conversation, Role, iter_conversations
from dsrecipes.run.preflight import writable_dir

DEFAULT_PROMPTS = SAMPLE_DATA_DIR / "prompts.jsonl"  # an example of the --prompts format
RESULT_KEY = "dsrecipes_prompt_eval"  # in every --json file we write: only such a file is ever replaced


@dataclass
class PromptRow:
    messages: List[Dict[str, Any]]  # the conversation so far (chat messages), answered by the model
    tools: Optional[list]
    reference: Optional[str]
    title: str  # what to print as the prompt


@dataclass
class Score:
    exact: int = 0
    contains: int = 0
    total: int = 0
    similarity: float = 0.0  # mean difflib ratio of answer and reference
    reference_loss: float = 0.0  # mean over prompts with a reference
    stopped: int = 0  # answers that ended with an end-of-turn token (not cut by --max-new-tokens)
    answers: List[str] = field(default_factory=list)


def prompt_rows(finetuned: Any, prompts: Optional[str], limit: int) -> List[PromptRow]:
    """What to ask: the --prompts file, else the validation conversations of the fine-tuned model's run."""
    if prompts:
        rows = read_prompts(Path(prompts))
    elif finetuned.run_dir is not None:
        rows = validation_rows(finetuned.run_dir)
    else:
        raise UserError(f"{finetuned.path}: no run to take validation conversations from; pass --prompts FILE")
    return rows[:limit]


def compare(finetuned: Any, baseline: Optional[Any], rows: List[PromptRow], max_new_tokens: int) -> Dict[str, Score]:
    """Scores per model. The baseline is prompted through the fine-tuned template and stopped at its end-of-turn
    tokens: the same prompts, the same stopping rule."""
    from dsrecipes.serve.inference import ChatModel  # lazy: else `commands.prompt_eval` imports torch 3.80 s

    tuned = ChatModel(finetuned)
    models = {"finetuned": tuned}
    if baseline is not None:
        models = {"baseline": ChatModel(baseline, tuned.tokenizer.chat_template, tuned.stop_ids), "finetuned": tuned}
        if Path(baseline.path).name == EXPORT_INIT_DIR:
            print(random_start_note(baseline.path, len(rows), max_new_tokens), flush=True)
    return {name: evaluate(m, rows, max_new_tokens) for name, m in models.items()}


def random_start_note(path: Path, prompts: int, max_new_tokens: int) -> str:
    """Why the tiny model's baseline is slow and answers "": it is kept (the floor the fine-tuned scores and
    reference loss are measured from), and said once, before it runs."""
    return (f"baseline: {path} is the embedded tiny model's random start (never trained): it almost never ends a "
            f"turn, so each of its {prompts} answers runs to --max-new-tokens {max_new_tokens} (most of this "
            "command's time), and what it generates is mostly special tokens, shown as an empty answer. It is the "
            "floor the fine-tuned scores are measured from; leave out --baseline to skip it")


def read_prompts(path: Path) -> List[PromptRow]:
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "is not a file" if path.exists() else "does not exist"
        raise UserError(f"--prompts: {path} {what}; give a JSONL file of prompts")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"--prompts: {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UserError(f"--prompts: cannot read {path} ({exc.strerror or exc})") from None
    rows = []
    for line_no, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = loads_bounded(line, "JSON nested too deeply to be a prompt")  # a shared file's nested brackets
        except Unreadable as exc:
            raise UserError(f"{path}:{line_no}: {exc}") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{line_no}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f"{path}:{line_no}: each line needs a string 'prompt'")
        for key in ("reference", "system"):
            if row.get(key) is not None and not isinstance(row[key], str):
                raise UserError(f"{path}:{line_no}: '{key}' must be a string")
        messages = [{"role": "system", "content": row["system"]}] if row.get("system") else []
        messages.append({"role": "user", "content": row["prompt"]})
        rows.append(PromptRow(messages, None, row.get("reference"), row["prompt"]))
    if not rows:
        raise UserError(f"{path}: no prompts")
    return rows


def validation_rows(run_dir: Path) -> List[PromptRow]:
    """The run's held-out conversations: everything before the last reply is the prompt, the reply the reference."""
    from dsrecipes.data.prepare.build import (  # lazy: else `commands.prompt_eval` imports numpy 0.11 s
        STATS_FILE,
        load_prepared,
    )

    cfg = load_run_config(run_dir)
    if not (run_dir / STATS_FILE).is_file():
        raise UserError(f"{run_dir}: no prepared validation split here (data=map runs have one); pass --prompts FILE")
    val = load_prepared(cfg, run_dir).val
    if val is None:
        raise UserError(f"{run_dir}: the run has no validation split (dataset.val_size=0); pass --prompts FILE")
    wanted = {sample_id for ids in val["ids"] for sample_id in ids}
    found: Dict[str, List[Conversation]] = {}
    for conv in iter_conversations(cfg.dataset, report=BadRowReport(BadRows.skip, 1.0)):
        if conv.id in wanted:
            found.setdefault(conv.id, []).append(conv)
    convs = {sample_id: c[0] for sample_id, c in found.items() if len(c) == 1}
    if len(convs) < len(found):  # an id of two conversations: which one was held out is not known from the id
        shared = sorted(set(found) - set(convs))
        note = (f"{len(shared)} of the {len(found)} validation ids name more than one conversation in the data (e.g. "
                f"{shared[:3]}: files of the same name, or an id column that repeats)")
        if not convs:
            raise UserError(f"{run_dir}: {note}, so no held-out conversation can be told apart from a trained one; give "
                            "the samples unique ids, or pass --prompts FILE")
        print(f"note: {note}; they are left out, so that no trained conversation is scored as held out", flush=True)
    rows = []
    for sample_id, conv in convs.items():  # in data order
        last = conv.turns[-1]  # normalisation ends every conversation with its last reply
        prompt = Conversation(conv.id, conv.turns[:-1], conv.system, conv.tools)
        messages, tools = chat_messages(prompt)
        reference = tool_call_text(last.content) if last.role is Role.tool_call else last.content
        title = next((m["content"] for m in reversed(messages) if m["role"] != "assistant"), "(no prompt)")
        rows.append(PromptRow(messages, tools, reference, f"[{sample_id}] {title}"))
    return rows


def evaluate(model: Any, rows: List[PromptRow], max_new_tokens: int) -> Score:
    score = Score()
    losses, similarities = [], []
    for row in rows:
        prompt_ids = model.encode(model.prompt_text(row.messages, row.tools))
        new_ids = model.generate(prompt_ids, max_new_tokens)
        score.stopped += bool(new_ids) and new_ids[-1] in model.stop_ids
        answer = model.answer_text(new_ids)
        score.answers.append(answer)
        if row.reference is None:
            continue
        score.total += 1
        score.exact += normalize(answer) == normalize(row.reference)
        score.contains += normalize(row.reference) in normalize(answer)
        similarities.append(difflib.SequenceMatcher(None, normalize(answer), normalize(row.reference)).ratio())
        losses.append(model.reference_loss(row.messages, row.tools, row.reference))
    score.reference_loss = sum(losses) / len(losses) if losses else float("nan")
    score.similarity = sum(similarities) / len(similarities) if similarities else float("nan")
    return score


def print_side_by_side(rows: List[PromptRow], scores: Dict[str, Score]) -> None:
    for i, row in enumerate(rows):
        print(f"==========prompt {i + 1}/{len(rows)}==========")
        print(visible(row.title))  # the prompt file's and the models' text, control characters escaped
        for name, score in scores.items():
            print(f"----------{name}: greedy----------")
            print(visible(score.answers[i]))
        if row.reference is not None:
            print("----------reference----------")
            print(visible(row.reference))
        print()
    print("==========score==========")
    for name, score in scores.items():
        print(f"{name:<10} exact {score.exact}/{score.total}  contains {score.contains}/{score.total}  "
              f"similarity {score.similarity:.3f}  reference loss {score.reference_loss:.3f}  "
              f"stopped at end of turn {score.stopped}/{len(score.answers)}")


# ---------------------------------------------------------------------------------------------------------------
# --json


def check_json_out(out: str) -> Path:
    """Where `--json` may write, checked before any model is loaded (and again just before writing): a new file in
    an existing or creatable writable directory, or a result an earlier prompt-eval wrote (RESULT_KEY). A directory,
    a user's file, a symbolic link, a path inside an export or a run's checkpoints: UserError, nothing written."""
    path = Path(out).expanduser()
    if path.is_dir():
        raise UserError(f"--json: {path} is a directory; give a file to write the scores to")
    for problem in writable_dir("--json", path.parent):
        raise UserError(problem)
    inside = _signed_dir_around(path.resolve())
    if inside is not None:
        raise UserError(f"--json: {path} lies inside {inside}, an export or a run's checkpoints, whose files are "
                        "signed; write the scores elsewhere. Nothing was written")
    if (path.exists() or path.is_symlink()) and not _our_result(path):
        raise UserError(f"--json: {path} exists and is not a prompt-eval result (no {RESULT_KEY!r}); dsrecipes "
                        "replaces only its own results. Choose another file; nothing was written")
    return path


def write_scores(out: str, scores: Dict[str, Score]) -> Path:
    """The scores, answers included, at `out` (atomically; checked again first): one UserError when it cannot be
    written (disk full, permissions), and then nothing is left there."""
    path = check_json_out(out)
    try:
        return atomic_write_json(path, {RESULT_KEY: 1, **{k: asdict(v) for k, v in scores.items()}}, indent=1)
    except OSError as exc:
        raise UserError(f"--json: cannot write {path} ({exc.strerror or exc}); nothing was written") from None


def _our_result(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    try:
        data = loads_bounded(path.read_bytes(), "JSON nested too deeply to be a prompt-eval result")
    except (OSError, ValueError):  # (Unreadable, UnicodeDecodeError and JSONDecodeError are ValueErrors)
        return False
    return isinstance(data, dict) and data.get(RESULT_KEY) == 1


def _signed_dir_around(where: Path) -> Optional[Path]:
    """The export (its marker) or the run's export or checkpoints directory that `where` lies in, if any."""
    signed_names = (EXPORT_DIR, EXPORT_INIT_DIR, CHECKPOINTS_DIR)
    for parent in where.parents:
        of_run = parent.name in signed_names and (parent.parent / MARKER_FILE).exists()
        if of_run or (parent / EXPORT_INFO).exists():
            return parent
    return None
