"""TRL's standard (plain-text) rows under `dataset=openai_messages`: a string `prompt` is one user turn, a string
`chosen` / `rejected` one assistant answer, rendered with the template like the same row written as message lists
(data/sources/samples.py, preference.py). And `dsrecipes score --pairs` on a file that holds no pairs says what a
pair row needs.

Real preparation (data/prepare/build.py `prepare`, the tiny tokenizer) of a small file of each shape.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from dsrecipes.core.errors import DataError, UserError

QUESTIONS = [f"What is {a} plus {a + 1}?" for a in range(12)]


def _write(path: Path, rows: List[Dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _user(text: str) -> List[Dict[str, str]]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> List[Dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def _prepared(tmp_path: Path, name: str, rows: List[Dict[str, Any]], *overrides: str) -> Dict[str, List[Any]]:
    """Every column of the prepared train rows of `rows` (written to NAME.jsonl), in the order of the file."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.prepare.build import prepare

    data = _write(tmp_path / f"{name}.jsonl", rows)
    cfg = compose_and_load([*overrides, "dataset=openai_messages", f"dataset.paths=[{data}]", "dataset.val_size=0",
                            "data.cutoff_len=128", f"data.cache_dir={tmp_path / 'cache'}"])
    train = prepare(cfg, load_tokenizer(cfg), tmp_path / f"run_{name}").train
    return {c: train[c] for c in train.column_names if c != "ids"}


def _same_rows(plain: Dict[str, List[Any]], lists: Dict[str, List[Any]], n: int) -> None:
    assert plain.keys() == lists.keys()
    for col in plain:
        assert len(plain[col]) == n, col
        assert plain[col] == lists[col], col


def test_plain_text_pairs_prepare_as_the_same_pairs_written_as_message_lists(tmp_path):
    """`{"prompt": str, "chosen": str, "rejected": str}` (TRL's standard preference rows) used to stop at line 1:
    `conversation_not_list ('messages' is a str)`. Now: the token ids of every prepared pair equal those of the
    conversational rows."""
    plain = [{"prompt": q, "chosen": f"It is {2 * i + 1}.", "rejected": "I do not know."}
             for i, q in enumerate(QUESTIONS)]
    lists = [{"prompt": _user(r["prompt"]), "chosen": _assistant(r["chosen"]), "rejected": _assistant(r["rejected"])}
             for r in plain]
    a = _prepared(tmp_path, "plain", plain, "objective=dpo", "objective.reference=live")
    b = _prepared(tmp_path, "lists", lists, "objective=dpo", "objective.reference=live")
    _same_rows(a, b, len(QUESTIONS))


def test_plain_text_prompts_prepare_as_the_same_prompts_written_as_message_lists(tmp_path):
    """`{"prompt": str}` (TRL's standard prompt-only rows, for GRPO) used to stop at line 1; now one user turn."""
    plain = [{"prompt": q, "reference": str(2 * i + 1)} for i, q in enumerate(QUESTIONS)]
    lists = [{**r, "prompt": _user(r["prompt"])} for r in plain]
    grpo = ("objective=grpo", "objective.max_completion_length=8", "objective.num_generations=2")
    a = _prepared(tmp_path, "plain", plain, *grpo)
    b = _prepared(tmp_path, "lists", lists, *grpo)
    _same_rows(a, b, len(QUESTIONS))


def test_plain_text_rows_get_the_checks_of_message_lists(tmp_path):
    """A blank plain answer is `empty_answer`, equal plain answers `identical_sides`, a prompt that is neither text
    nor a list names the `prompt` column (not `messages`), and bad_rows=skip counts them as for message lists."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.prepare.build import prepare

    good = [{"prompt": q, "chosen": "yes", "rejected": "no"} for q in QUESTIONS]
    bad = [{"prompt": "q", "chosen": " ", "rejected": "no"}, {"prompt": "q", "chosen": "a", "rejected": "a"},
           {"prompt": 7, "chosen": "a", "rejected": "b"}]
    for i, (row, message) in enumerate(zip(bad, (r":1: empty_answer", r":1: identical_sides",
                                                 r":1: conversation_not_list \('prompt' is a int"))):
        data = _write(tmp_path / f"bad{i}.jsonl", [row, *good])
        cfg = compose_and_load(["objective=dpo", "objective.reference=live", "dataset=openai_messages",
                                f"dataset.paths=[{data}]", "dataset.val_size=0", f"data.cache_dir={tmp_path}/c"])
        with pytest.raises(DataError, match=message):
            prepare(cfg, load_tokenizer(cfg), tmp_path / "run")
    data = _write(tmp_path / "mixed.jsonl", [*bad, *good])
    cfg = compose_and_load(["objective=dpo", "objective.reference=live", "dataset=openai_messages",
                            f"dataset.paths=[{data}]", "dataset.val_size=0", "dataset.bad_rows=skip",
                            "dataset.max_bad_fraction=0.5", f"data.cache_dir={tmp_path}/c"])
    stats = prepare(cfg, load_tokenizer(cfg), tmp_path / "run").stats
    assert stats["samples"]["train"] == len(good), stats
    assert stats["skipped"] == {"conversation_not_list": 1, "empty_answer": 1, "identical_sides": 1}, stats
    quarantined = [json.loads(line) for line in Path(stats["quarantine"]).read_text(encoding="utf-8").splitlines()]
    assert [(q["line"], q["raw"]) for q in quarantined] == list(zip((1, 2, 3), bad))


@pytest.mark.parametrize("row", [
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
], ids=["sharegpt", "openai"])
def test_score_pairs_on_an_sft_file_says_what_a_pair_needs(tmp_path, row):
    """An SFT file given to `dsrecipes score --pairs` said `bad_value (the prompt ends with a assistant turn ...)`
    (or, for `messages` rows, that there is no `conversations` field): neither says the rows are no pairs. Now the
    message names the missing chosen/rejected answers and what a pair row holds."""
    from dsrecipes.commands.score import read_pairs

    path = _write(tmp_path / "sft.jsonl", [row, row])
    with pytest.raises(UserError) as err:
        read_pairs(path)
    message = str(err.value)
    assert message.startswith(f"{path}:1: missing_side"), message
    assert "'chosen'" in message and "'rejected'" in message and "a assistant" not in message, message


def test_score_pairs_reads_plain_text_pairs_as_their_message_lists(tmp_path):
    """`dsrecipes score --pairs` reads pairs like training does: TRL's standard rows too, as the conversational ones."""
    from dsrecipes.commands.score import read_pairs

    plain = {"prompt": "What is 2 plus 3?", "chosen": "5", "rejected": "6"}
    lists = {"prompt": _user(plain["prompt"]), "chosen": _assistant("5"), "rejected": _assistant("6")}
    (_, a), (_, b) = (read_pairs(_write(tmp_path / f"{n}.jsonl", [r]))[0] for n, r in (("a", plain), ("b", lists)))
    assert (a.prompt.turns, a.prompt.system, a.chosen, a.rejected) == (b.prompt.turns, b.prompt.system, "5", "6")
