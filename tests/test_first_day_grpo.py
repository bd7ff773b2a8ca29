"""A first day with online RL: the README's GRPO smoke command on CPU, and what preparation says about rows the
cutoff leaves nothing to train on."""

from __future__ import annotations

import re
from pathlib import Path

from dsrecipes.cli import main

README = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
SMOKE = "python -m dsrecipes objective=grpo dataset=sample_prompts debug=fast"


def _prepare(tmp_path, *overrides):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.prepare.build import prepare

    cfg = compose_and_load([*overrides, f"data.cache_dir={tmp_path}"])
    return prepare(cfg, load_tokenizer(cfg), tmp_path / "run").stats


def test_the_readme_grpo_smoke_command_prepares_the_bundled_prompts(tmp_path, capsys):
    """GRPO had no CPU smoke command: `objective=grpo debug=fast` validated 'OK' and the run was refused at
    'train.jsonl:1: bad_value (the prompt ends with a assistant turn ...)' (the default dataset holds conversations),
    and the bundled prompts.jsonl (12 prompt-eval rows, a string `prompt`) is no prompt-row file and has fewer rows than
    debug=fast's val_size (16). Now `dataset=sample_prompts` reads the bundled pairs' 481 single-turn prompts with
    their answers as `reference`, all within debug=fast's cutoff less the completion (192 - 64), and the README's
    GRPO section says the command."""
    section = README.split("\n## Online RL (GRPO) on prompts\n", 1)[1].split("\n## ", 1)[0]
    assert re.search(rf"^    {re.escape(SMOKE)}$", section, re.M), "the README's GRPO section names no smoke command"
    code = main(["validate", *SMOKE.split()[3:]])
    said = capsys.readouterr()
    assert code == 0 and "warning" not in said.out + said.err, said
    stats = _prepare(tmp_path, *SMOKE.split()[3:])
    assert stats["samples"] == {"train": 384, "val": 16}, stats
    assert stats["skipped_total"] == 0 and stats["rows_read"] == 400, stats


def test_preparation_says_how_many_rows_the_cutoff_left_nothing_to_train_on(tmp_path, capsys):
    """`dataset=glaive_toolcall debug=fast` keeps few of its rows at cutoff 192 (tool schemas fill the prompt), and
    preparation said '400 rows read, 96 kept, skipped: none' and '304 dropped (nothing trained left)', naming no key.
    Now a note says how many of the rows read were dropped, why, and that data.cutoff_len keeps them."""
    stats = _prepare(tmp_path, "dataset=glaive_toolcall", "debug=fast", "dataset.max_samples=40", "dataset.val_size=2")
    dropped, read = stats["dropped_all_trained_cut"], stats["rows_read"]
    assert 0 < dropped < read, stats
    said = capsys.readouterr().err
    assert f"note: {dropped} of {read} rows ({dropped / read:.0%}) dropped: data.cutoff_len=192 cut all their " \
        "trained tokens" in said and "a larger data.cutoff_len keeps them" in said, said
    capsys.readouterr()
    _prepare(tmp_path / "sample", "debug=fast", "dataset.max_samples=40", "dataset.val_size=2")
    assert "note:" not in capsys.readouterr().err
