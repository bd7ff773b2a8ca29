"""A model directory's hostile chat template on the training side (issue 21 item 4): `template=tokenizer`,
`template=auto` and `validate` / `inspect-data` render it only in chat_sandbox, so a template that loops for ever or
reaches for Python internals is one message naming it, exit 2, within seconds, also in the data-preparation worker
processes and in a thread that is not the main one. (chat / prompt-eval on such directories: test_trust.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dsrecipes.cli import main as cli
from dsrecipes.core.paths import TINY_TOKENIZER_DIR

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
ROW = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HOSTILE = {
    "loops for ever": LOOP + ROW,
    "python internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}" + ROW,
}
# Renders plain exchanges (validate's probe, the encoder's probes) and loops on a row that holds LOOPME: only the
# data-preparation workers meet the loop.
LOOPS_ON_A_ROW = ("{% for m in messages %}{% if 'LOOPME' in m['content'] %}" + LOOP + "{% endif %}{% endfor %}" + ROW)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """The tiny model's config and weights, saved once (the tokenizer files come from TINY_TOKENIZER_DIR)."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.modeling.model import build_tiny_model, load_tokenizer

    cfg = compose_and_load(["debug=fast"])
    out = tmp_path_factory.mktemp("weights")
    build_tiny_model(cfg, load_tokenizer(cfg)).save_pretrained(out)
    return out


def model_dir(weights: Path, tmp_path: Path, template: str) -> Path:
    out = tmp_path / "model"
    shutil.copytree(TINY_TOKENIZER_DIR, out)
    for name in os.listdir(weights):
        shutil.copy(weights / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return out


def data_file(tmp_path: Path, loop_row: bool = False) -> Path:
    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                              {"from": "gpt", "value": f"answer {i}"}]} for i in range(64)]
    if loop_row:
        rows[40]["conversations"][0]["value"] = "LOOPME please"
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def one_message(err: str, model: Path) -> None:
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert f"{model}: chat_template" in err and "chat template" in err, err


def overrides(model: Path, tmp_path: Path, data: Path, *more: str) -> list:
    return [f"model.path={model}", "debug=fast", f"dataset.paths=[{data}]", f"trainer.output_dir={tmp_path / 'run'}",
            f"data.cache_dir={tmp_path / 'cache'}", *more]


def assert_nothing_prepared(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    written = [p for p in cache.rglob("*") if p.is_file() and p.name != "file_hashes.json"] if cache.exists() else []
    assert not written, written  # no cache entry, complete or half (the data files' hash memo is not one)
    run = tmp_path / "run"
    assert not any(run.rglob("*.pt")) and not any(run.rglob("*.safetensors"))
    if (run / "result.json").exists():
        assert json.loads((run / "result.json").read_text())["status"] == "failed"


def test_training_with_a_template_that_loops_on_a_row_stops_in_the_workers(weights, tmp_path):
    """`python -m dsrecipes ... template=tokenizer data.preprocess_workers=2`: the row that loops is rendered in a
    worker process, whose budget holds: one message, exit 2, in seconds."""
    model = model_dir(weights, tmp_path, LOOPS_ON_A_ROW)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dsrecipes",
                           *overrides(model, tmp_path, data_file(tmp_path, loop_row=True), "template=tokenizer",
                                      "data.preprocess_workers=2")],
                          capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path)
    took = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    one_message(done.stderr, model)
    assert "ran longer than 2 s" in done.stderr
    assert took < 60, took  # start-up under load included; without the budget it never ends
    assert_nothing_prepared(tmp_path)


@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.parametrize("template", ["tokenizer", "auto"])
def test_training_refuses_a_hostile_template_before_reading_rows(weights, tmp_path, capsys, name, template):
    model = model_dir(weights, tmp_path, HOSTILE[name])
    started = time.monotonic()
    assert cli(overrides(model, tmp_path, data_file(tmp_path), f"template={template}")) == 2
    assert time.monotonic() - started < 30
    one_message(capsys.readouterr().err, model)
    assert_nothing_prepared(tmp_path)


@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.parametrize("command", ["validate", "inspect-data"])
def test_validate_and_inspect_data_name_a_hostile_template(weights, tmp_path, capsys, name, command):
    model = model_dir(weights, tmp_path, HOSTILE[name])
    started = time.monotonic()
    assert cli([command, *overrides(model, tmp_path, data_file(tmp_path), "template=tokenizer")]) == 2
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{model}: chat_template" in err, err
    assert_nothing_prepared(tmp_path)


def test_a_built_in_template_on_a_hostile_model_is_refused_by_the_renders_differently_check(weights, tmp_path):
    from transformers import AutoTokenizer

    from dsrecipes.boundary.chat_sandbox import TemplateRefused
    from dsrecipes.core.schema import TemplateConfig, TemplateKind
    from dsrecipes.data.render.template_choice import template_warnings

    tokenizer = AutoTokenizer.from_pretrained(model_dir(weights, tmp_path, HOSTILE["loops for ever"]))
    started = time.monotonic()
    with pytest.raises(TemplateRefused, match="ran longer than 2 s"):
        template_warnings(TemplateConfig(name=TemplateKind.chatml), tokenizer)
    assert time.monotonic() - started < 5


def test_the_time_budget_holds_outside_the_main_thread(tmp_path, monkeypatch):
    """The time limit holds in any thread (the parent kills the renderer child; no signal or exception is aimed at
    the rendering thread), and nothing fires after a render has finished."""
    from dsrecipes.boundary import chat_sandbox
    from dsrecipes.data.render.tokenizer_files import open_tokenizer

    monkeypatch.setattr(chat_sandbox, "MAX_SECONDS", 0.5)
    model = tmp_path / "tok"
    shutil.copytree(TINY_TOKENIZER_DIR, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HOSTILE["loops for ever"]}))
    hostile, plain = open_tokenizer(model), open_tokenizer(TINY_TOKENIZER_DIR)
    outcome = []

    def run() -> None:
        try:
            chat_sandbox.render(hostile, [{"role": "user", "content": "hi"}])
        except chat_sandbox.TemplateRefused as exc:
            outcome.append(str(exc))
        outcome.append(chat_sandbox.render(plain, [{"role": "user", "content": "hi"}]))
        time.sleep(1.0)  # past the budget of the finished render
        outcome.append("not shot")

    started = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive() and time.monotonic() - started < 10
    assert len(outcome) == 3 and "ran longer than 0.5 s" in outcome[0], outcome
    assert outcome[1].startswith("<|im_start|>user") and outcome[2] == "not shot"
