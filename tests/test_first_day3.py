"""A first day, third pass: what `dsrecipes show`, `validate` and `debug=fast` said to a new user, and what they
say now."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_first_day2 import _run  # `dsrecipes ARGV` in this process: (exit code, stdout + stderr)


def _optimizer_lr_line(said: str) -> str:
    lines = said.splitlines()
    start = lines.index("optimizer:")
    return next(line for line in lines[start:] if line.startswith("  lr:"))


def test_show_prints_the_learning_rate_the_run_uses(capsys):
    """`dsrecipes show` printed `optimizer: lr: null` for the default config, though the run trains at the tiny
    model's 0.003 (config/defaults.py; the DeepSpeed JSON further down said 0.003). Now the resolved config says
    what the run directory's config.yaml will say, and where the value came from; an explicit rate is printed as
    set, without a note."""
    code, said = _run(capsys, "show")
    assert code == 0, said
    assert _optimizer_lr_line(said) == "  lr: 0.003  # model.tiny.finetune_lr (optimizer.lr unset)", said
    code, said = _run(capsys, "show", "optimizer.lr=1e-4")
    assert code == 0 and _optimizer_lr_line(said) == "  lr: 0.0001", said


def test_validate_says_how_many_rows_the_validation_split_leaves_to_train_on(tmp_path, capsys):
    """A small file of one's own (100 rows) under the default dataset.val_size (64, the bundled sample's) validated
    'OK' and trained on 36 rows; dataset.max_samples=60 validated 'OK' and was refused by the run after reading every
    row. Now validate warns with the rows of each split where it knows them (rows counted in small local files,
    dataset.max_samples), and refuses a hold-out that leaves nothing to train on; the bundled sample says nothing."""
    sample = (Path(__file__).parents[1] / "dsrecipes" / "assets" / "sample_data" / "train.jsonl").read_text()
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(sample.splitlines(keepends=True)[:100]))
    code, said = _run(capsys, "validate", f"dataset.paths=[{mine}]")
    assert code == 0 and "warning: dataset.val_size: 64 held out of at most 100 rows (counted in the dataset " \
        "files) leaves at most 36 to train on (64% or more for validation)" in said, said
    code, said = _run(capsys, "validate", f"dataset.paths=[{mine}]", "dataset.val_size=0.5")
    assert code == 0 and "0.5 holds out 50 of at most 100 rows" in said and "trains on at most 50" in said, said
    code, said = _run(capsys, "validate", "dataset.max_samples=60")
    assert code == 2 and "dataset.val_size: 64 validation samples leave nothing to train on (at most 60 rows, " \
        "dataset.max_samples)" in said, said
    for fine in ([], ["dataset.max_samples=200"], [f"dataset.paths=[{mine}]", "dataset.val_size=10"]):
        code, said = _run(capsys, "validate", *fine)
        assert code == 0 and "dataset.val_size" not in said, (fine, said)


BUNDLED = [[], ["objective=dpo", "dataset=sample_pairs"], ["objective=orpo", "dataset=sample_pairs"],
           ["objective=reward", "dataset=sample_pairs"], ["dataset=glaive_toolcall"]]  # fmt: skip


@pytest.mark.parametrize("choice", BUNDLED[:4], ids=lambda c: " ".join(c) or "defaults")
def test_debug_fast_prepares_the_bundled_rows_and_pairs_whole(tmp_path, choice):
    """`python -m dsrecipes objective=dpo dataset=sample_pairs debug=fast` (the README's DPO command with the smoke
    preset) was refused: 'pairs.jsonl:30: prompt_too_long (the prompt has 130 tokens; data.cutoff_len is 128)'.
    debug=fast's cutoff (128) was shorter than the bundled pairs with tools (every pair fits in 192) and cut 17 of its
    400 sample conversations. Now its cutoff is 192 and the first 400 rows are prepared whole, the pairs as the rows
    the objective trains on (objective.reference=live: no reference pass; it runs under the same cutoff)."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.prepare.build import prepare

    cfg = compose_and_load([*choice, "debug=fast", "objective.reference=live", f"data.cache_dir={tmp_path}"])
    prepared = prepare(cfg, load_tokenizer(cfg), tmp_path / "run")
    assert prepared.stats["samples"] == {"train": 384, "val": 16}, prepared.stats
    assert prepared.stats.get("truncated", 0) == 0, prepared.stats


@pytest.mark.parametrize("choice", [[f"recipe={r}"] for r in ("cpu_zero2_two_ranks", "smollm2_cpu_dpo", "smollm2_cpu_sft")]
                         + BUNDLED, ids=lambda c: " ".join(c) or "defaults")
def test_debug_fast_validates_with_each_recipe_and_bundled_dataset_that_runs_here(capsys, choice):
    """debug=fast onto each shipped recipe whose files ship with dsrecipes (the others name /models and /data paths
    of a cluster) and each bundled dataset with the objectives that train on it."""
    code, said = _run(capsys, "validate", *choice, "debug=fast")
    assert code == 0 and "warning" not in said, said
