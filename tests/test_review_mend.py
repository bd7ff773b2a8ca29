"""Pins of behaviour that review refactors fold into one place: each test held before its refactor and must hold
after it, message for message."""

from __future__ import annotations

import json

import pytest

from dsrecipes.core.errors import UserError

# config.json -> (score's refusal after the directory, objective.reward_model's problem after the path); None: a scorer
SCORER_CASES = [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
     "a text-generating model (LlamaForCausalLM), not a reward model; dsrecipes score takes the export of an "
     "objective=reward run (a scalar score head)",
     "is a text-generating model (LlamaForCausalLM), not a reward model: its score head would be new and random, "
     "and so every reward; give an objective=reward export"),
    ({"architectures": ["LlamaForSequenceClassification"], "num_labels": 3},
     "a reward model has one label (a scalar score), this one has 3 (config.json; an objective=reward export has one)",
     "has 3 labels in config.json; a reward model has one (a scalar score): give an objective=reward export"),
    ({"architectures": ["LlamaForSequenceClassification"]},  # transformers' default: 2 labels
     "a reward model has one label (a scalar score), this one has 2 (config.json; an objective=reward export has one)",
     "has 2 labels in config.json; a reward model has one (a scalar score): give an objective=reward export"),
    ({"architectures": ["LlamaForSequenceClassification"], "num_labels": "one"},  # not a number: -1
     "a reward model has one label (a scalar score), this one has -1 (config.json; an objective=reward export has one)",
     "has -1 labels in config.json; a reward model has one (a scalar score): give an objective=reward export"),
    ({"architectures": ["LlamaForCausalLM"], "id2label": {"0": "a", "1": "b"}},  # a generator: named as one
     "a text-generating model (LlamaForCausalLM), not a reward model",
     "is a text-generating model (LlamaForCausalLM), not a reward model"),
    ({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "LABEL_0"}, "num_labels": 2}, None, None),
    ({"architectures": ["LlamaForCausalLM"], "num_labels": 1}, None, None),  # one label: the head decides, not the name
    ({"num_labels": 1}, None, None),
]


def _model(tmp_path, config):
    model = tmp_path / "export"
    model.mkdir()
    (model / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    (model / "model.safetensors").write_bytes(b"")  # never read: judged before loading
    return model


@pytest.mark.parametrize("config,score,reward", SCORER_CASES, ids=[f"case{i}" for i in range(len(SCORER_CASES))])
def test_score_and_the_reward_model_judge_a_scorer_alike(tmp_path, config, score, reward):
    from dsrecipes.commands.score import check_model_dir
    from dsrecipes.objectives.rewards import reward_model_problems

    model = _model(tmp_path, config)
    if score is None:
        check_model_dir(model)
        assert reward_model_problems(str(model)) == []
        return
    with pytest.raises(UserError) as refused:
        check_model_dir(model)
    assert str(refused.value).startswith(f"{model}: {score}"), str(refused.value)
    (problem,) = reward_model_problems(str(model))
    assert problem.startswith(f"objective.reward_model: {model} {reward}"), problem


@pytest.mark.parametrize("text,said", [("[1, 2]", "holds a list, not a model config (a JSON object)"),
                                       ("{not json", "not a readable JSON model config")])
def test_a_config_that_is_no_model_config_is_named_by_both(tmp_path, text, said):
    from dsrecipes.commands.score import check_model_dir
    from dsrecipes.objectives.rewards import reward_model_problems

    model = _model(tmp_path, text)
    with pytest.raises(UserError, match="config.json") as refused:
        check_model_dir(model)
    assert str(refused.value).startswith(f"{model / 'config.json'}: {said}"), str(refused.value)
    (problem,) = reward_model_problems(str(model))
    assert problem.startswith(f"objective.reward_model: {model / 'config.json'}: {said}"), problem


@pytest.mark.parametrize("config,arch", [
    ({"architectures": ["LlamaForSequenceClassification"], "num_labels": 3}, "LlamaForSequenceClassification"),
    ({"architectures": ["LlamaForCausalLM"], "num_labels": 1}, None),
    ({"architectures": ["LlamaForSequenceClassification", "LlamaForCausalLM"]}, None),
    ({"architectures": []}, None),
])
def test_chat_refuses_every_sequence_classifier(tmp_path, config, arch):
    """Chat / prompt-eval / the report ask another question than score: does it score instead of writing text (every
    architecture a sequence classifier), whatever its number of labels."""
    from dsrecipes.core.export_dir import scorer_architecture

    assert scorer_architecture(_model(tmp_path, config)) == arch
