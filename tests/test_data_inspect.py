"""`dsrecipes inspect-data`: rendered rows with trained tokens marked, statistics, clean errors."""

from __future__ import annotations

from pathlib import Path

from dsrecipes import cli

FIX = Path(__file__).parent / "fixtures" / "data"


def test_inspect_renders_rows_and_statistics(tmp_path, capsys):
    argv = [f"data.cache_dir={tmp_path / 'cache'}", "dataset.max_samples=60", "dataset.val_size=4", "data.packing=true",
            "data.cutoff_len=128", "--rows", "2", "--color", "never", "--run-dir", str(tmp_path / "run")]
    assert cli.main(["inspect-data", *argv]) == 0
    out = capsys.readouterr().out
    assert out.count("=== train row") == 2 and "--- sample " in out
    assert "[[" in out and "<|im_end|>]]" in out  # trained reply + its end token, bracketed
    assert "rows read 60, kept 60, skipped 0" in out and "packing efficiency: train" in out
    assert "sample length (tokens)" in out and (tmp_path / "run" / "prepare_stats.json").is_file()


def test_inspect_colours_when_asked(tmp_path, capsys):
    argv = [f"data.cache_dir={tmp_path / 'cache'}", "dataset.max_samples=20", "dataset.val_size=0", "--rows", "1",
            "--color", "always", "--split", "train"]
    assert cli.main(["inspect-data", *argv]) == 0
    assert "\033[42;30m" in capsys.readouterr().out


def test_bad_data_is_one_message_and_exit_2(tmp_path, capsys, monkeypatch):
    import tempfile

    temp = tmp_path / "tmp"  # where inspect-data makes its stats directory (no --run-dir)
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    argv = [f"data.cache_dir={tmp_path / 'cache'}", f"dataset.paths=[{FIX / 'bad_rows.jsonl'}]", "dataset.max_samples=null"]
    assert cli.main(["inspect-data", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "bad_rows.jsonl:2: invalid_json" in err[0]
    assert list(temp.iterdir()) == []  # its empty stats directory is removed, not left behind


def test_inspect_data_of_pairs_shows_both_sides_and_no_third_party_bar(tmp_path):
    """A fresh process (no bar already switched off by another test): `inspect-data objective=dpo` prints the prompt
    and both answers with their trained spans and reference log-probs, and no `datasets` progress bar."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    argv = [sys.executable, "-m", "dsrecipes", "inspect-data", "objective=dpo", "dataset=sample_pairs",
            "dataset.max_samples=12", "dataset.val_size=4", f"data.cache_dir={tmp_path / 'cache'}", "--rows", "1",
            "--color", "never"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=subprocess_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--- chosen:" in done.stdout and "--- rejected:" in done.stdout and "reference log-prob" in done.stdout
    assert "[[" in done.stdout  # the trained answer span, bracketed
    screen = done.stdout + done.stderr
    assert "Saving the dataset" not in screen and "examples/s" not in screen, screen[-2000:]
