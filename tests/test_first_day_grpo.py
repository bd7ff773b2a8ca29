"""A first day with online RL: the README's GRPO smoke command on CPU, and what preparation says about rows the
cutoff leaves nothing to train on."""

from __future__ import annotations


def _prepare(tmp_path, *overrides):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.prepare.build import prepare

    cfg = compose_and_load([*overrides, f"data.cache_dir={tmp_path}"])
    return prepare(cfg, load_tokenizer(cfg), tmp_path / "run").stats


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
