"""core/fileio.read_json_file and loads_bounded: the one bounded JSON reader behind read_record (complete.json),
tokenizer.read_json (a model directory's settings), the safetensors header check and --prompts lines."""

import os

import pytest

from dsrecipes.core.fileio import MAX_JSON_BYTES, Unreadable, loads_bounded, read_json_file

DEEP = "[" * 100000
TOO_DEEP = "JSON nested too deeply to be a test's record"


def test_a_json_file_reads_as_its_value(tmp_path):
    (tmp_path / "ok.json").write_text('{"step": 3, "names": ["a", "\u00e9"]}', encoding="utf-8")
    assert read_json_file(tmp_path / "ok.json", TOO_DEEP) == {"step": 3, "names": ["a", "\u00e9"]}
    assert MAX_JSON_BYTES == 64 << 20


def test_json_nested_too_deeply_is_unreadable_with_the_callers_words(tmp_path):
    (tmp_path / "deep.json").write_text(DEEP, encoding="utf-8")
    with pytest.raises(Unreadable) as err:  # was json.loads' RecursionError (a traceback) at every call site
        read_json_file(tmp_path / "deep.json", TOO_DEEP)
    assert str(err.value) == TOO_DEEP and isinstance(err.value, ValueError)
    for text in (DEEP, DEEP.encode(), '{"a":' * 50000):
        with pytest.raises(Unreadable, match="^JSON nested too deeply to be a test's record$"):
            loads_bounded(text, TOO_DEEP)


def test_a_file_over_the_limit_is_never_read_whole(tmp_path):
    (tmp_path / "big.json").write_text("[" + " " * 100 + "]", encoding="utf-8")
    with pytest.raises(Unreadable, match=r"^larger than 64 bytes$"):
        read_json_file(tmp_path / "big.json", TOO_DEEP, limit=64)
    assert read_json_file(tmp_path / "big.json", TOO_DEEP, limit=102) == []  # exactly the limit reads


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(Unreadable, match="^not a regular file$"):
        read_json_file(tmp_path / "fifo.json", TOO_DEEP)


def test_not_json_not_utf8_and_missing_stay_what_they_were(tmp_path):
    # callers tell these apart from Unreadable: absent (OSError) or damaged (a plain ValueError) falls back
    (tmp_path / "bad.json").write_text("{nope", encoding="utf-8")
    (tmp_path / "latin.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError) as err:
        read_json_file(tmp_path / "bad.json", TOO_DEEP)
    assert not isinstance(err.value, Unreadable) and "Expecting property name" in str(err.value)
    with pytest.raises(UnicodeDecodeError):
        read_json_file(tmp_path / "latin.json", TOO_DEEP)
    with pytest.raises(FileNotFoundError):
        read_json_file(tmp_path / "missing.json", TOO_DEEP)
    with pytest.raises(ValueError) as err:
        loads_bounded("{nope", TOO_DEEP)
    assert not isinstance(err.value, Unreadable)


def test_prompt_eval_json_out_nested_too_deeply_is_a_users_file_not_a_traceback(tmp_path):
    # Was: serve/prompt_eval._our_result handed an existing --json FILE to json.loads: `dsrecipes prompt-eval
    # --json FILE` on a file of 100000 '[' ended in json's RecursionError traceback, exit 1.
    from dsrecipes.core.errors import UserError
    from dsrecipes.serve.prompt_eval import check_json_out

    (tmp_path / "scores.json").write_text(DEEP, encoding="utf-8")
    with pytest.raises(UserError, match="exists and is not a prompt-eval result"):
        check_json_out(str(tmp_path / "scores.json"))
