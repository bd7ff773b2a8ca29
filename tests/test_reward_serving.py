"""A reward model scores; it does not write. After `objective=reward`, the closing summary names `dsrecipes score`,
and chat / prompt-eval refuse its export with that command instead of loading it as a causal language model.

Was (tried: `dsrecipes debug=fast objective=reward dataset=sample_pairs data.cutoff_len=512 trainer.max_steps=2`):
the summary's next commands were `compare: dsrecipes prompt-eval ...` and `chat: dsrecipes chat RUN`; chat loaded the
LlamaForSequenceClassification export with AutoModelForCausalLM (transformers' 'UNEXPECTED: score.weight' report
on the console) and answered 256 tokens of noise; prompt-eval scored that noise against the references."""

from __future__ import annotations

import pytest

from tests.conftest import in_process_environ
from tests.test_messages_hostile import refused


@pytest.fixture(scope="module")
def reward_run(tmp_path_factory):
    from dsrecipes.cli import main

    root = tmp_path_factory.mktemp("reward_serving")
    run = root / "run"
    with in_process_environ():
        code = main(["debug=fast", "objective=reward", "dataset=sample_pairs", "dataset.max_samples=24",
                     "dataset.val_size=4", "data.cutoff_len=512", "trainer.max_steps=1", "trainer.eval_at_start=false",
                     f"data.cache_dir={root / 'cache'}", f"trainer.output_dir={run}", f"hydra.run.dir={run}"])
    assert code == 0
    return run


def test_the_summary_names_score_not_chat(reward_run):
    from dsrecipes.observe.report import next_commands

    said = dict(next_commands(reward_run, ["objective=reward"], 1, 1))
    assert said["score pairs:"] == f"dsrecipes score {reward_run / 'export'} --pairs PAIRS.jsonl", said
    assert "chat:" not in said and "compare:" not in said, said


@pytest.mark.parametrize("argv", [["chat", "{run}", "--message", "hi"], ["chat", "{run}/export", "--message", "hi"],
                                  ["prompt-eval", "--finetuned", "{run}"],
                                  ["prompt-eval", "--baseline", "{run}", "--finetuned", "{run}"]])
def test_chat_and_prompt_eval_refuse_a_reward_model_naming_score(reward_run, argv, capsys):
    argv = [a.format(run=reward_run) for a in argv]
    err = refused(capsys, argv, f"{reward_run / 'export'}: a reward model (LlamaForSequenceClassification",
                  f"dsrecipes score {reward_run / 'export'} --pairs PAIRS.jsonl")
    assert "UNEXPECTED" not in err  # refused before transformers loaded anything


def test_score_takes_the_export(reward_run, tmp_path, capsys):
    import json

    from dsrecipes.cli import main

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 2 + 2?"}],
                                 "chosen": [{"role": "assistant", "content": "2 + 2 = 4."}],
                                 "rejected": [{"role": "assistant", "content": "2 + 2 = 5."}]}) + "\n")
    with in_process_environ():
        assert main(["score", str(reward_run / "export"), "--pairs", str(pairs)]) == 0
    assert "pairs" in capsys.readouterr().out
