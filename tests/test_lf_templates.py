"""LLaMA-Factory templates that are chatml plus a default system prompt (register_template's default_system in its
src/llamafactory/data/template.py: qwen, opencoder, chatml_de, dbrx) put that prompt in every conversation without
one. They were translated to `template: chatml` alone, so a migrated recipe trained other tokens than LLaMA-Factory,
without a word; and sailor (turns `<|im_start|>question` / `<|im_start|>answer`) is no chatml at all. Now the
translation writes `template.default_system` beside the template, and sailor has no twin (a `#` line, a person
decides)."""

from __future__ import annotations

import pytest
import yaml

from dsrecipes.config.flat_check import flat_problems, in_our_keys
from dsrecipes.core.schema import TrainOn
from dsrecipes.data.render.template import render
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

QWEN = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
LF_SYSTEMS = {"qwen": QWEN, "opencoder": "You are OpenCoder, created by OpenCoder Team.",
              "chatml_de": "Du bist ein freundlicher und hilfsbereiter KI-Assistent."}


def _translated(data):
    (problem,) = [p for p in flat_problems(data, "f.yaml", lambda _: None) if "template" in p]
    return problem, in_our_keys(data)


@pytest.mark.parametrize("name", [*LF_SYSTEMS, "dbrx"])
def test_a_chatml_template_with_a_default_system_prompt_keeps_it(name):
    problem, text = _translated({"stage": "sft", "template": name})
    ours = yaml.safe_load(text)
    assert ours["template"] == "chatml", text
    system = ours["template.default_system"]
    if name == "dbrx":  # LF's long prompt, its lines and its em dash included
        assert system.startswith("You are DBRX, created by Databricks.") and system.count("\n") == 5, system
        assert "code blocks \u2014 remember" in system and system.endswith("PERTINENT TO THE USER'S QUERY."), system
    else:
        assert system == LF_SYSTEMS[name], text
        assert f"here: template: chatml with template.default_system: {system!r}" in problem, problem
    assert f"LLaMA-Factory's {name} template is chatml plus its default system prompt" in problem, problem


@pytest.mark.parametrize("name, ours", [("yi", "chatml"), ("qwen3_nothink", "chatml"), ("default", "human_assistant"),
                                        ("empty", "plain")])
def test_templates_without_a_default_system_prompt_translate_without_one(name, ours):
    problem, text = _translated({"stage": "sft", "template": name})
    eot = {"template.train_eot_newline": True} if ours == "chatml" else {}  # LF's "{{content}}<|im_end|>\n" (walk6)
    assert yaml.safe_load(text) == {"objective": "sft", "template": ours, **eot}, text
    assert "plus its default system prompt" not in problem, problem


def test_alpaca_says_its_default_system_prompt():
    problem, _ = _translated({"stage": "sft", "template": "alpaca"})
    assert "closest to plain" in problem and "'Below is an instruction that describes a task." in problem, problem


def test_sailor_is_not_chatml():
    problem, text = _translated({"stage": "sft", "template": "sailor"})
    assert "# template: sailor\n" in text and "\ntemplate" not in "\n" + text, text
    assert "sailor template is not chatml" in problem and "'<|im_start|>question' / '<|im_start|>answer'" in problem
    assert "here: template: auto" in problem, problem


@pytest.mark.parametrize("first", [True, False])
def test_the_files_own_default_system_wins(first):
    items = [("default_system", "Be brief."), ("template", "qwen")]
    data = dict(items if first else items[::-1])
    text = in_our_keys({"stage": "sft", **data})
    assert text.count("template.default_system") == 1, text
    assert yaml.safe_load(text)["template.default_system"] == "Be brief.", text


def test_the_translated_file_composes_and_renders_lfs_system_turn(tmp_path, make_cfg):
    recipe = tmp_path / "lf.yaml"
    recipe.write_text(in_our_keys({"stage": "sft", "template": "qwen"}))
    cfg = make_cfg(f"recipe={recipe}", check_files=False)

    class Tok:
        bos_token, eos_token = None, "<|im_end|>"

    conv = Conversation("x", [Turn(Role.user, "q"), Turn(Role.assistant, "a")])
    text = "".join(s.text for s in render(conv, cfg.template, Tok(), TrainOn.assistant))
    # LLaMA-Factory's qwen: format_system, then format_user, then format_assistant
    assert text == (f"<|im_start|>system\n{QWEN}<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
                    "<|im_start|>assistant\na<|im_end|>\n"), text
