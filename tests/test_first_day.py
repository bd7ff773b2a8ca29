"""Issue 49 (a LLaMA-Factory user's first day), items 1, 2 and 5.

- Named data replaces the bundled sample: `dataset.use` (the README's registry) trains on its own rows only, the
  console names every source with its row count, `validate` shows the same sources as `train`; `dataset.mix_sample`
  mixes them back in.
- An early-stopped run: the same command trains nothing, so it is refused (exit 2, result.json kept); the printed
  "train further" command trains the remaining steps and result.json keeps the earlier stop; a finished run resumed
  with the same budget is refused too.
- `validate` refuses the sources `train` refuses (a ranking entry under SFT, a plain entry under DPO) with the same
  words.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from dsrecipes.cli import main
from dsrecipes.core.paths import SAMPLE_DATA_DIR
from tests.conftest import REPO, in_process_environ


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> Path:
    """The README's dataset_info.json example, its chats folder holding 80 conversations."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    info = json.loads(re.search(r"### Datasets by name.*?```json\n(.*?)```", readme, re.S).group(1))
    data = tmp_path_factory.mktemp("first_day") / "data"
    (data / "chats").mkdir(parents=True)
    shutil.copy(SAMPLE_DATA_DIR.parent / "glaive_toolcall" / "glaive_toolcall_en_demo.json.gz", data)
    rows = [{"conversations": [{"role": "user", "content": f"what is {i} plus {i}?"},
                               {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]} for i in range(80)]
    (data / "chats" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "alpaca_de.jsonl").write_text(json.dumps({"instruction": "Sag hallo", "output": "Hallo"}) + "\n")
    info["prefs"] = {"file_name": "prefs.jsonl", "formatting": "sharegpt", "ranking": True,
                     "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}
    (data / "prefs.jsonl").write_text("")
    (data / "dataset_info.json").write_text(json.dumps(info))
    return data / "dataset_info.json"


def _cli(capsys, *args: str):
    with in_process_environ():
        code = main(list(args))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.out + captured.err


def test_named_data_replaces_the_sample_and_validate_shows_it(registry, make_cfg, capsys):
    from dsrecipes.data.sources.registry import resolve_sources

    use = [f"dataset.registry={registry}", "dataset.use=[my_chats]"]
    code, out = _cli(capsys, "validate", *use)
    assert code == 0 and "dataset=my_chats " in out, out
    assert [s.name for s in resolve_sources(make_cfg(*use).dataset)] == ["my_chats"]
    mixed = resolve_sources(make_cfg(*use, "dataset.mix_sample=true").dataset)
    assert [s.name for s in mixed] == ["sample", "my_chats"]
    code, out = _cli(capsys, "validate", *use, "dataset.mix_sample=true")
    assert code == 0 and "dataset=sample+my_chats " in out, out
    code, out = _cli(capsys, "validate")  # nothing named: the sample, as before
    assert code == 0 and "dataset=sample " in out, out


def test_validate_refuses_the_sources_train_refuses(registry, capsys):
    code, out = _cli(capsys, "validate", f"dataset.registry={registry}", "dataset.use=[prefs]")
    assert code == 2 and "source 'prefs' holds preference (ranking) rows" in out, out
    code, out = _cli(capsys, "validate", f"dataset.registry={registry}", "dataset.use=[my_chats]", "objective=dpo")
    assert code == 2 and "source 'my_chats' is not preference data" in out, out


RUN = ["debug=fast", "trainer.log_every=1", "optimizer.lr=3e-3", "data.cutoff_len=64", "dataset.val_size=8",
       "trainer.eval_every=2", "trainer.eval_samples=8", "trainer.early_stopping.patience=1",
       "trainer.early_stopping.min_delta=100", "trainer.export=false", "trainer.report_to=[]", "launcher=local"]


def test_an_early_stopped_run_continues_with_the_printed_command(registry, tmp_path, capsys):
    run = tmp_path / "run"
    first = [*RUN, f"dataset.registry={registry}", "dataset.use=[my_chats]", f"data.cache_dir={tmp_path / 'cache'}",
             f"trainer.output_dir={run}", f"hydra.run.dir={run}"]
    code, out = _cli(capsys, *first)
    assert code == 0, out[-3000:]
    assert "data: per source: my_chats 80 rows (72 train)" in out and "sample" not in out.split("run directory")[0]
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] == 4 and result["stopped_early"], result  # min_delta 100

    code, again = _cli(capsys, *first)  # the same command: it would stop at step 4 again
    assert code == 2 and "nothing to train" in again and "stopped early" in again, again[-2000:]
    assert json.loads((run / "result.json").read_text()) == result  # nothing written, the stop kept

    further = re.search(r"train further:\s+(.*)", out).group(1)
    assert "trainer.early_stopping.patience=0" in further
    code, out = _cli(capsys, *shlex.split(further)[1:])
    assert code == 0, out[-3000:]
    done = json.loads((run / "result.json").read_text())
    assert done["status"] == "ok" and done["steps"] == 8, done
    assert [s["step"] for s in done["earlier_stops"]] == [4] and "did not improve" in done["earlier_stops"][0]["reason"]

    code, out = _cli(capsys, *shlex.split(further)[1:])  # finished: the same budget trains nothing
    assert code == 2 and "nothing to train" in out and "trainer.max_steps above 8" in out, out[-2000:]

    tags = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    code, out = _cli(capsys, "export", str(run), "--tag", "step_99", "--out", str(tmp_path / "x"))
    assert code == 2 and f"its complete checkpoints: {', '.join(tags)} (choose one with --tag)" in out, out
    code, out = _cli(capsys, "export", str(run / "checkpoints" / "step_8"), "--out", str(tmp_path / "x"))
    assert code == 0 and f"exported {run / 'checkpoints' / 'step_8'} -> " in out, out  # = RUN --tag step_8
    code, out = _cli(capsys, "export", str(run / "checkpoints" / "step_8"), "--tag", "step_4", "--out",
                     str(tmp_path / "y"))
    assert code == 2 and "but --tag names step_4" in out, out


def test_an_offline_hub_id_is_refused_by_validate_with_trains_words(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    code, validated = _cli(capsys, "validate", "model.path=NoSuchOrg/NoSuchModel")
    code2, trained = _cli(capsys, "model.path=NoSuchOrg/NoSuchModel", f"trainer.output_dir={tmp_path / 'r'}",
                          f"hydra.run.dir={tmp_path / 'r'}", "launcher=local")
    line = "error: model.path: 'NoSuchOrg/NoSuchModel' is not a local directory, and HF_HUB_OFFLINE is set"
    assert code == code2 == 2 and line in validated and line in trained, (validated, trained)


def test_the_random_start_baseline_says_why_it_is_slow_and_empty(tmp_path, capsys, monkeypatch):
    import dsrecipes.serve.inference as inference
    from dsrecipes.serve import prompt_eval as pe
    from dsrecipes.serve.inference import ModelPath

    class Fake:
        def __init__(self, *args):
            self.tokenizer, self.stop_ids = type("T", (), {"chat_template": ""})(), [0]

    monkeypatch.setattr(inference, "ChatModel", Fake)
    monkeypatch.setattr(pe, "evaluate", lambda *a: pe.Score())
    pe.compare(ModelPath(tmp_path / "export", False), ModelPath(tmp_path / "export_init", False), [], 48)
    out = capsys.readouterr().out
    assert "is the embedded tiny model's random start (never trained)" in out and "--max-new-tokens 48" in out
    pe.compare(ModelPath(tmp_path / "export", False), ModelPath(tmp_path / "base", False), [], 48)
    assert "random start" not in capsys.readouterr().out  # a real base model: no note


def test_shard_names_a_store_prefix_as_a_url():
    from dsrecipes.commands.shard import inside

    assert inside("s3://bucket/shards/", "quarantine.jsonl") == "s3://bucket/shards/quarantine.jsonl"
    assert inside("out", "quarantine.jsonl") == "out/quarantine.jsonl"


def test_the_sweep_table_has_an_accuracy_column_when_jobs_report_one(tmp_path):
    from dsrecipes.observe import sweep
    from tests.test_sweep import fake_job

    for num, (beta, acc) in enumerate((("0.1", 0.5), ("0.3", 0.75))):
        fake_job(tmp_path, num, [f"objective.beta={beta}"], {"status": "ok", "error": None},
                 [{"step": 4, "loss": 0.6}, {"step": 4, "eval_loss": 0.6, "eval_reward_accuracy": acc}])
    md = sweep.render_markdown(sweep.collect(tmp_path)).splitlines()
    assert "| eval_reward_accuracy |" in md[0] and "| 0.7500 |" in md[3], md
    plain = tmp_path / "plain"
    fake_job(plain, 0, ["x=1"], {"status": "ok", "error": None}, [{"step": 1, "loss": 3.0}])
    assert "accuracy" not in sweep.render_markdown(sweep.collect(plain))


def test_an_iterable_run_says_what_an_epoch_trains(tmp_path, capsys):
    """100 lines, 10 bad (skipped), 10 held out: 90 training lines of which 9 bad, 81 trainable; an epoch is 22
    steps of 4, so 2 rows of each epoch's order wait for the next (before: "100 training samples per epoch")."""
    rows = []
    for i in range(100):
        good = json.dumps({"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]})
        rows.append("not json" if i % 20 == 13 else json.dumps({"conversations": [{"from": "human", "value": "x"}]})
                    if i % 20 == 7 else good)
    (tmp_path / "bad.jsonl").write_text("\n".join(rows) + "\n")
    code, out = _cli(capsys, "data=iterable", "debug=fast", "trainer.max_steps=1", "trainer.eval_every=0",
                     f"dataset.paths=[{tmp_path / 'bad.jsonl'}]", "dataset.bad_rows=skip",
                     "dataset.max_bad_fraction=0.5", "dataset.val_size=10", f"data.cache_dir={tmp_path / 'cache'}",
                     f"trainer.output_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'run'}",
                     "trainer.export=false", "trainer.report_to=[]", "launcher=local")
    assert code == 0, out[-3000:]
    assert "10 validation rows, 81 training samples per epoch (90 lines, 9 bad rows skipped)" in out, out
    assert "an epoch is 22 steps of 4 rows, so the last 2 of its 90 training rows" in out, out


def test_check_budget_completes_an_unfinished_end_and_refuses_a_finished_one():
    from dsrecipes.core.errors import Refused
    from dsrecipes.run.resume_contract import check_budget

    es = {"trainer": {"early_stopping": {"patience": 1, "min_delta": 100}}}
    stopped = {"stopped_early": "early stopping: ...", "total_steps": 8}
    assert check_budget("step_8", 8, 8, {}, es, es, finished=False) is False  # killed while exporting: completed
    assert check_budget("step_4", 4, 8, stopped, es, es, finished=False) is False  # stops again, exports
    assert check_budget("step_4", 4, 16, stopped, es, es, finished=True) is True  # a larger budget goes on
    off = {"trainer": {"early_stopping": {"patience": 0, "min_delta": 100}}}
    assert check_budget("step_4", 4, 8, stopped, es, off, finished=True) is True
    for args in (("step_8", 8, 8, {}), ("step_4", 4, 8, stopped)):
        with pytest.raises(Refused, match="nothing to train"):
            check_budget(*args, es, es, finished=True)


def test_the_local_launcher_on_a_machine_with_several_gpus_says_it_trains_on_one(make_cfg, monkeypatch, capsys):
    """A LLaMA-Factory (torchrun) user's `dsrecipes train x.yaml` on an 8-GPU machine trained on one GPU, silently."""
    from dsrecipes.run import entry

    monkeypatch.setattr(entry, "local_devices", lambda: 4)
    entry.one_of_many_gpus(make_cfg())
    assert capsys.readouterr().err == ("note: launcher=local trains on 1 of this machine's 4 GPUs; "
                                       "launcher=deepspeed (or torchrun) trains on all of them\n")
    entry.one_of_many_gpus(make_cfg("launcher=deepspeed"))
    entry.one_of_many_gpus(make_cfg("trainer.device=cpu"))
    monkeypatch.setattr(entry, "local_devices", lambda: 1)
    entry.one_of_many_gpus(make_cfg())
    assert capsys.readouterr().err == ""


def test_a_run_directory_or_an_adapter_as_model_path_names_the_model_to_give(tmp_path):
    """model.path=RUN (what `dsrecipes chat` takes) or an adapter export: 'not a Hugging Face model directory' said
    what it is not; now also which directory (or command) gives the model."""
    from dsrecipes.core.rundir import MARKER_FILE
    from dsrecipes.run.preflight import check_model_dir

    run, adapter = tmp_path / "run", tmp_path / "adapter"
    run.mkdir()
    (run / MARKER_FILE).write_text("{}")
    (problem,) = check_model_dir("model.path", run, False)
    assert problem.endswith(f"but a dsrecipes run directory: its model is dsrecipes export {run} --out DIR, then "
                            "model.path=DIR"), problem
    (run / "export").mkdir()
    assert check_model_dir("model.path", run, False)[0].endswith(f"its model is model.path={run / 'export'}")
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    assert "but a LoRA adapter: train on a merged model" in check_model_dir("model.path", adapter, False)[0]
    assert check_model_dir("model.path", tmp_path, False)[0].endswith("it is not a Hugging Face model directory")
