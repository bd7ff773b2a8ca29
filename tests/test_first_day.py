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
