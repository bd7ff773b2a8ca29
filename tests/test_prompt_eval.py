"""`dsrecipes prompt-eval` on two untrained tiny models (fast); the trained comparison is in test_train_runs.py."""

from __future__ import annotations

import json

import pytest

from dsrecipes.cli import main as cli
from dsrecipes.serve.prompt_eval import DEFAULT_PROMPTS, read_prompts


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.rank.export import export_initial

    root = tmp_path_factory.mktemp("prompt_eval")
    dirs = []
    for seed in (1, 2):
        cfg = compose_and_load(["debug=fast", f"model.tiny.seed={seed}"])
        dirs.append(export_initial(cfg, load_tokenizer(cfg), root / f"seed{seed}"))
    return dirs


def test_bundled_prompts_have_references():
    rows = read_prompts(DEFAULT_PROMPTS)
    assert rows and all(r.messages[-1]["role"] == "user" and r.reference for r in rows)


def test_side_by_side_and_scores(two_models, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "What is 2 + 2?", "reference": "2 + 2 = 4."}, {"prompt": "Say hi.", "system": "Be brief."}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "scores.json"
    code = cli(["prompt-eval", "--baseline", str(two_models[0]), "--finetuned", str(two_models[1]),
                "--prompts", str(prompts), "--max-new-tokens", "4", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert printed.count("----------baseline: greedy") == 2 and printed.count("----------finetuned: greedy") == 2
    assert "----------reference----------\n2 + 2 = 4." in printed
    scores = json.loads(out.read_text())
    for name in ("baseline", "finetuned"):
        assert scores[name]["total"] == 1 and len(scores[name]["answers"]) == 2  # only one prompt has a reference
        assert scores[name]["reference_loss"] > 5  # untrained: about log(vocab)


def test_bad_paths_are_user_errors(two_models, tmp_path, capsys):
    assert cli(["prompt-eval", "--baseline", str(tmp_path), "--finetuned", str(two_models[1])]) == 2
    assert "not a run directory, a Hugging Face model directory" in capsys.readouterr().err
    assert cli(["prompt-eval", "--baseline", str(two_models[0]), "--finetuned", str(two_models[1]),
                "--prompts", str(tmp_path / "missing.jsonl")]) == 2


def test_prompts_file_mistakes_name_the_line(two_models, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n', encoding="utf-8")
    assert cli(["prompt-eval", "--finetuned", str(two_models[1]), "--prompts", str(bad)]) == 2
    assert f"{bad}:2: each line needs a string 'prompt'" in capsys.readouterr().err
    bad.write_text('{"prompt": "ok"}\n{not json\n', encoding="utf-8")
    assert cli(["prompt-eval", "--finetuned", str(two_models[1]), "--prompts", str(bad)]) == 2
    assert f"{bad}:2: not JSON" in capsys.readouterr().err
    # An export with no run behind it has no validation conversations to ask.
    assert cli(["prompt-eval", "--finetuned", str(two_models[1])]) == 2
    assert "pass --prompts FILE" in capsys.readouterr().err


def test_chat_one_message_and_an_interactive_session(two_models, monkeypatch, capsys):
    assert cli(["chat", str(two_models[0]), "--message", "What is 2 + 2?", "--max-new-tokens", "3"]) == 0
    printed = capsys.readouterr()
    assert "[3 tokens, cut at --max-new-tokens 3]" in printed.err or "end of turn" in printed.err
    lines = iter(["Hi", "/reset", "What is 2 + 2?"])

    def fake_input(prompt: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)
    assert cli(["chat", str(two_models[0]), "--system", "Be brief.", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "/reset starts over" in err and err.count(" tokens, ") == 2  # two replies; /reset is not a message


def test_an_adapter_whose_base_is_gone_is_one_message(tmp_path, capsys):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "gone")}))
    assert cli(["chat", str(tmp_path), "--message", "hi"]) == 2
    assert "is not a local model directory here" in capsys.readouterr().err


def test_a_plain_base_model_directory_is_accepted_with_its_own_template(tmp_path, capsys):
    """A Hugging Face directory nobody exported (no dsrecipes_export.json, its tokenizer's own chat template, its
    own generation_config): prompt-eval and chat both load it; prompt-eval needs --prompts (no run behind it)."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.modeling.model import build_tiny_model, load_tokenizer

    cfg = compose_and_load(["debug=fast"])
    tokenizer = load_tokenizer(cfg)
    base = tmp_path / "base"
    build_tiny_model(cfg, tokenizer).save_pretrained(base)
    tokenizer.save_pretrained(base)
    assert not (base / "dsrecipes_export.json").exists() and tokenizer.chat_template
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 2 + 2?", "reference": "4"}) + "\n", encoding="utf-8")
    out = tmp_path / "s.json"
    assert cli(["prompt-eval", "--finetuned", str(base), "--baseline", str(base), "--prompts", str(prompts),
                "--max-new-tokens", "3", "--json", str(out)]) == 0
    scores = json.loads(out.read_text())
    assert scores["finetuned"]["total"] == scores["baseline"]["total"] == 1
    assert scores["finetuned"]["reference_loss"] == pytest.approx(scores["baseline"]["reference_loss"])
    assert cli(["chat", str(base), "--message", "Hi", "--max-new-tokens", "3"]) == 0
    assert cli(["prompt-eval", "--finetuned", str(base)]) == 2  # no run: nothing to take held-out rows from
    assert "pass --prompts FILE" in capsys.readouterr().err
