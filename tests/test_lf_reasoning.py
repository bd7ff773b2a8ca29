"""LLaMA-Factory's reasoning templates (qwen3, deepseekr1: ReasoningTemplate in its data/template.py) train an empty
`<think>\\n\\n</think>\\n\\n` block before every answer without a <think> part (enable_thinking: true, its default).
`template: qwen3` was translated to `template: chatml`, which adds none: a migrated recipe trained other tokens than
LLaMA-Factory did, without a word. Now such a template has no twin: the translated file keeps it as a `#` line and its
problem says what differs and what to write."""

from __future__ import annotations

import pytest

from dsrecipes.cli import main
from dsrecipes.config.flat_check import flat_problems, in_our_keys

EMPTY_THINK = r"'<think>\n\n</think>\n\n'"  # LF's thought_words ("<think>\n", "\n</think>\n\n") joined


def _translated(template: str):
    data = {"stage": "sft", "template": template}
    (problem,) = [p for p in flat_problems(data, "f.yaml", lambda _: None) if "template" in p]
    return problem, in_our_keys(data)


@pytest.mark.parametrize("name, ours", [("qwen3", "template: chatml adds none"),
                                        ("deepseekr1", "template: auto renders the model tokenizer's own")])
def test_a_reasoning_template_is_not_translated_silently(name, ours):
    problem, text = _translated(name)
    assert f"# template: {name}\n" in text and "\ntemplate:" not in "\n" + text, text
    assert f"LLaMA-Factory's {name} template is" in problem and f"empty thinking block {EMPTY_THINK}" in problem
    assert "enable_thinking: true, its default" in problem and ours in problem, problem
    assert f"start each answer without a <think> part with {EMPTY_THINK} in your data" in problem, problem


@pytest.mark.parametrize("name", ["qwen", "qwen3_nothink"])
def test_the_chatml_templates_without_thinking_still_translate(name):
    problem, text = _translated(name)
    assert "template: chatml\n" in text and "<think>" not in problem, (problem, text)


def test_template_qwen3_on_the_command_line_says_what_differs(capsys):
    assert main(["validate", "template=qwen3"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "LLaMA-Factory's qwen3 template is chatml plus an empty thinking block" in err
    assert "(LLaMA-Factory's qwen3_nothink)" in err, err
