"""A sceptical reviewer's attacks on the trust boundary that found a hole, each run for real through the CLI (offline,
tiny model, in this process): the test fails on the code before its fix.

- A shared recipe's defaults list climbing out of the config tree (`override /debug: ../../../PATH/evil`): Hydra's
  file and package sources join the name to their folder, so the file at PATH loaded under the config tree's name,
  and config/safety.py took its `trainer.tracking_uri` / `data.cache_dir` as the config tree's (the user's), not the
  shared recipe's: validate said OK and the tracking server would have received MLFLOW_TRACKING_TOKEN.
- A model directory's config.json naming its attention (`attn_implementation: "org/repo"`, or flash_attention_2
  without flash-attn): transformers fetched that Hub kernel with the `kernels` package and loaded its native code,
  in `chat` / `prompt-eval` and for a GRPO reward model a shared recipe names.
- A foreign checkpoint's complete.json holding 1e999 or a list where a number belongs: tracebacks from signing
  (json.dumps allow_nan=False) and, trusted, from int(world_size) / float(saved_at).
- A YAML dataset registry (any recipe may name one) or a shared run directory's config.yaml with an alias bomb:
  validate / prompt-eval --baseline ran past a minute, memory growing.
- A pipeline file's `from_export: {KEY: STAGE}` could set the keys its `set:` may not (a batch job's activate
  script, written directories, the MLflow store).
- A trusted foreign export whose dsrecipes_export.json `run_dir` is not a string: a TypeError traceback in chat."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsrecipes.cli import main as cli_main
from tests.test_messages_hostile import refused


def _climb(target: Path) -> str:
    """A defaults-list option name that leads from any folder of the search path to `target` (absolute)."""
    return "../" * 40 + str(target).lstrip("/")


@pytest.mark.parametrize("how", ["file by path", "recipe folder"])
@pytest.mark.parametrize("entry", ["override /debug", "/trainer@_global_"])
def test_a_defaults_entry_cannot_climb_out_of_the_config_tree(how, entry, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "evil.yaml").write_text("# @package _global_\ntrainer:\n  tracking_uri: http://127.0.0.1:9/steal\n"
                                      "data:\n  cache_dir: /tmp/dsr-redteam-elsewhere\n", encoding="utf-8")
    (folder / "sft.yaml").write_text(f"# @package _global_\ndefaults:\n  - {entry}: {_climb(folder / 'evil')}\n"
                                     "trainer:\n  max_steps: 2\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSRECIPES_RECIPES", str(folder))
    recipe = "recipe=./shared/sft.yaml" if how == "file by path" else "recipe=sft"
    err = refused(capsys, ["validate", recipe], "'..'", "sft.yaml", "outside the config tree")
    assert "127.0.0.1" not in err
    if how == "file by path" and entry.startswith("override"):
        refused(capsys, ["show", recipe], "outside the config tree")


def test_the_same_climb_on_the_command_line_is_refused_too(tmp_path, monkeypatch, capsys):
    (tmp_path / "evil.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: 3\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    refused(capsys, ["validate", f"debug={_climb(tmp_path / 'evil')}"], "'..'", "outside the config tree")


def test_a_recipe_file_above_the_working_directory_still_composes(tmp_path, monkeypatch, capsys):
    (tmp_path / "mine.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: 3\n", encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert cli_main(["validate", "recipe=../mine.yaml"]) == 0, capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------
# A model directory choosing code through its config.json




def _with_config(model_dir: Path, tmp_path: Path, **values) -> Path:
    import json
    import shutil

    out = tmp_path / "model"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **values}))
    return out


KERNELS = ["evil-org/attention", "kernels-community/flash-attn2", "flash_attention_2"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_model_directory_cannot_choose_a_hub_kernel_for_chat(kernel, model_dir, tmp_path, capsys, monkeypatch):
    """config.json `attn_implementation` naming a Hub kernel repository (or flash_attention_2 without flash-attn
    installed, which transformers replaces by kernels-community/flash-attn2): transformers downloads it with the
    `kernels` package and loads its native code. Was: `chat` tried exactly that (offline: 'not available in the
    local cache'); the directory's choice is now never read (transformers' default attention)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _with_config(model_dir, tmp_path, attn_implementation=kernel)
    code = cli_main(["chat", str(model), "--message", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "kernel" not in err.lower(), err


def _scorer(model_dir: Path, tmp_path: Path) -> Path:
    """A sequence-classification directory (the tiny model's body, one label) naming a Hub kernel."""
    from transformers import LlamaForSequenceClassification

    scorer = tmp_path / "scorer"
    LlamaForSequenceClassification.from_pretrained(model_dir, num_labels=1).save_pretrained(scorer)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).exists():
            (scorer / name).write_bytes((model_dir / name).read_bytes())
    return _with_config(scorer, tmp_path, attn_implementation="evil-org/attention")


def test_a_reward_model_directory_cannot_choose_a_hub_kernel(model_dir, tmp_path, monkeypatch):
    from dsrecipes.objectives.rewards import load_reward_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hostile = _scorer(model_dir, tmp_path)
    score = load_reward_model(str(hostile), "cpu")
    assert len(score(["hello"])) == 1


def test_dsrecipes_score_loads_no_kernel_a_model_directory_names(model_dir, tmp_path, monkeypatch):
    from dsrecipes.commands.score import load_scorer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, _ = load_scorer(_scorer(model_dir, tmp_path), "dsrecipes score")
    assert model.config._attn_implementation in ("sdpa", "eager")


# ---------------------------------------------------------------------------------------------------------------
# A checkpoint someone else wrote: its commit record is data


def _foreign_checkpoint(tmp_path: Path, **record) -> Path:
    """A run directory whose one checkpoint's complete.json (unsigned: another user's) holds `record`."""
    import json

    run = tmp_path / "foreign"
    tag = run / "checkpoints" / "step_8"
    tag.mkdir(parents=True)
    (run / "config.yaml").write_text("trainer:\n  max_steps: 8\n", encoding="utf-8")
    body = {"step": 8, "world_size": 1, "saved_at": 1.0, "files": {}, "signature": "hmac-sha256:" + "0" * 64, **record}
    (tag / "complete.json").write_text(json.dumps(body).replace("Infinity", "1e999"), encoding="utf-8")
    return tag


@pytest.mark.parametrize("record", [{"world_size": float("inf")}, {"note": float("inf")}, {"saved_at": [1]}])
def test_a_foreign_commit_record_that_json_cannot_sign_is_one_message(record, tmp_path, monkeypatch, capsys):
    """complete.json with 1e999 (read back as inf), or a list where a time belongs. Was: a ValueError traceback from
    signing (json.dumps allow_nan=False), an OverflowError or
    TypeError traceback from `int(world_size)` / `float(saved_at)` once the checkpoint was trusted on the command
    line; now one message: unsigned (naming --trust-checkpoint) or damaged (naming complete.json), and trusted, the
    next check's (this fake run's settings differ from the checkpoint's)."""
    monkeypatch.setenv("DSRECIPES_KEY_FILE", str(tmp_path / "key" / "checkpoint.key"))
    monkeypatch.chdir(tmp_path)
    tag = _foreign_checkpoint(tmp_path, **record)
    run = tag.parent.parent
    for trusted in ([], ["--trust-checkpoint", str(run)]):
        code = cli_main(["train", "debug=fast", f"trainer.output_dir={tmp_path / 'mine'}",
                         f"trainer.resume_from={run}", *trusted])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, (code, err)
        assert err.count("error: ") == 1 and "step_8" in err.split("error: ")[1], err
        if not trusted:
            assert "--trust-checkpoint" in err or "complete.json: unreadable" in err, err


@pytest.mark.parametrize("world_size", [10**30, (1 << 20) + 1])
def test_a_foreign_commit_records_absurd_world_size_is_one_message(world_size, tmp_path, monkeypatch, capsys):
    """complete.json saying 10**30 ranks wrote it. Was: a whole number >= 1, so accepted, and once trusted on the
    command line the resume planned for that many ranks (an elastic resume at another world size); now, trusted or
    not, one message naming complete.json and its world_size, exit 2, as other absurd record fields are."""
    from dsrecipes.core.checkpoint_names import MAX_WORLD_SIZE, read_record

    monkeypatch.setenv("DSRECIPES_KEY_FILE", str(tmp_path / "key" / "checkpoint.key"))
    monkeypatch.chdir(tmp_path)
    tag = _foreign_checkpoint(tmp_path, world_size=MAX_WORLD_SIZE)
    assert read_record(tag)["world_size"] == MAX_WORLD_SIZE  # the bound itself is still a record
    tag = _foreign_checkpoint(tmp_path / "absurd", world_size=world_size)
    run = tag.parent.parent
    for trusted in ([], ["--trust-checkpoint", str(run)]):
        code = cli_main(["train", "debug=fast", f"trainer.output_dir={tmp_path / 'mine'}",
                         f"trainer.resume_from={run}", *trusted])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and err.count("error: ") == 1, (code, err)
        assert str(tag) in err and "complete.json: unreadable" in err, err
        assert f"world_size {world_size if world_size < 10**12 else 'of 31 digits'} is more than 1048576 ranks" in err


# ---------------------------------------------------------------------------------------------------------------
# Dataset files a recipe names


def test_a_dataset_registry_alias_bomb_is_refused_in_milliseconds(tmp_path, capsys):
    """dataset.registry (a read-only input any recipe may name) in YAML: nine lines whose aliases expand to 9^9
    values. Was: yaml.safe_load shares the nodes, then typing the entry walked every expansion (validate ran past
    60 s, its memory growing); now read like a recipe file, within the same budget of values."""
    import time

    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    sample = Path(__file__).resolve().parents[1] / "dsrecipes" / "assets" / "sample_data" / "train.jsonl"
    registry = tmp_path / "registry.yaml"
    registry.write_text(f"mine:\n  paths: [{sample}]\n  roles:\n" + "".join(f"    {line}\n" for line in lines),
                        encoding="utf-8")
    started = time.monotonic()
    refused(capsys, ["validate", f"dataset.registry={registry}", "dataset.use=[mine]"], str(registry), "aliases")
    assert time.monotonic() - started < 10


def test_a_shared_run_directorys_config_alias_bomb_is_refused_in_milliseconds(model_dir, tmp_path, capsys):
    """A run directory someone shared: its config.yaml is read (prompt-eval --baseline, resume, export) before any
    signature is checked. Was: yaml.safe_load of nine alias lines under dataset.roles, then typing walked 9^9 values
    (prompt-eval ran past 40 s); now the same budget as a recipe file, one message naming the file."""
    import time

    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    run = tmp_path / "shared_run"
    run.mkdir()
    (run / "config.yaml").write_text("dataset:\n  roles:\n" + "".join(f"    {line}\n" for line in lines),
                                     encoding="utf-8")
    started = time.monotonic()
    code = cli_main(["prompt-eval", "--baseline", str(run), "--finetuned", str(model_dir)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert str(run / "config.yaml") in err and "aliases" in err, err
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("text", ["trainer: [unclosed\n", "trainer:\n  roles:\n" + "".join(
    f"    a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9 if i else ['"lol"'] * 9) + "]\n" for i in range(9))],
    ids=["broken YAML", "alias bomb"])
def test_a_trusted_foreign_checkpoints_settings_file_is_read_as_data(text, tmp_path, monkeypatch, capsys):
    """The settings a foreign checkpoint was trained with (its run's config.yaml), read by the resume contract once
    the user trusted it with --trust-checkpoint. Was: yaml.safe_load (a YAMLError traceback for broken YAML, an
    alias bomb walked without end); now read like a run's config.yaml: one message naming the file."""
    import time

    monkeypatch.setenv("DSRECIPES_KEY_FILE", str(tmp_path / "key" / "checkpoint.key"))
    monkeypatch.chdir(tmp_path)
    tag = _foreign_checkpoint(tmp_path)
    run = tag.parent.parent
    (run / "config.yaml").write_text(text, encoding="utf-8")
    started = time.monotonic()
    code = cli_main(["train", "debug=fast", f"trainer.output_dir={tmp_path / 'mine'}", f"trainer.resume_from={run}",
                     "--trust-checkpoint", str(run)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, (code, err)
    assert err.count("error: ") == 1 and str(run / "config.yaml") in err, err
    assert time.monotonic() - started < 20


def test_a_pipeline_file_cannot_point_a_users_setting_at_a_stages_export(tmp_path):
    """`from_export: {KEY: STAGE}` sets KEY to an earlier stage's export directory, and reaches `train` as a
    command-line override (the user's own to config/safety.py). Was: any key, so a shared pipeline file could set
    what its `set:` may not: the batch job's activate script (launcher.slurm_venv), the prepared-data cache,
    the MLflow store (trainer.tracking_uri); now refused with its line, like the same keys under `set:`."""
    from dsrecipes.config.pipeline_file import load_pipeline
    from dsrecipes.core.errors import ConfigError

    path = tmp_path / "shared_pipeline.yaml"
    path.write_text("stages:\n  - name: sft\n  - name: rm\n    from_export:\n      launcher.slurm_venv: sft\n"
                    "      data.cache_dir: sft\n      trainer.tracking_uri: sft\n", encoding="utf-8")
    with pytest.raises(ConfigError) as refused_:
        load_pipeline(path)
    problems = refused_.value.problems
    assert [p.split(": ", 1)[0] for p in problems] == [f"{path}:{n}" for n in (5, 6, 7)], problems
    assert "batch job" in problems[0] and "credentials" in problems[2]
    ok = tmp_path / "own_pipeline.yaml"
    ok.write_text("stages:\n  - name: sft\n  - name: grpo\n    from_export: {objective.reward_model: sft}\n",
                  encoding="utf-8")
    assert load_pipeline(ok).stages[1].from_export == {"objective.reward_model": "sft"}


@pytest.mark.parametrize("run_dir", [5, ["/x"], {"a": 1}])
def test_a_trusted_exports_run_dir_of_the_wrong_type_is_ignored(run_dir, model_dir, tmp_path, capsys, monkeypatch):
    """An export someone else wrote, trusted on the command line: its dsrecipes_export.json names the run it came from
    (`run_dir`: prompt-eval then reads that run's validation rows). Was: a number, list or object there was a
    TypeError traceback (Path(5)); now it names no run (the export loads alone)."""
    import json
    import shutil

    import dsrecipes.core.manifest as manifest

    monkeypatch.setenv("DSRECIPES_KEY_FILE", str(tmp_path / "key" / "checkpoint.key"))
    export = tmp_path / "export"
    shutil.copytree(model_dir, export)
    hashes = manifest.describe(export)
    (export / "dsrecipes_export.json").write_text(json.dumps({"run_dir": run_dir, "files": sorted(hashes),
                                                              "hashes": hashes}), encoding="utf-8")
    code = cli_main(["chat", str(export), "--message", "hi", "--max-new-tokens", "2", "--trust-checkpoint",
                     str(export)])
    err = capsys.readouterr().err
    assert code == 0 and "Traceback" not in err, err


# ---------------------------------------------------------------------------------------------------------------
# A model directory hiding a link past the bound of the link check


def test_a_link_outside_hidden_past_ten_thousand_entries_is_refused(tmp_path, make_cfg):
    """A model directory of 10,001 filler files beside additional_chat_templates/evil.jinja -> a secret outside.
    Was: outside_link_problems stopped walking after 10,000 entries and said nothing, so the hidden link was loaded
    as one of the model's templates; now a directory past the bound is refused whole, and every entry below it is
    checked otherwise."""
    import shutil

    from dsrecipes.core.errors import ConfigError
    from dsrecipes.core.paths import TINY_TOKENIZER_DIR
    from dsrecipes.core.tokenizer import MAX_ENTRIES, custom_code_problems, load_tokenizer

    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key = hunter2\n")
    model = tmp_path / "model"
    shutil.copytree(TINY_TOKENIZER_DIR, model)
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "evil.jinja").symlink_to(secret)
    assert "is a link leading outside" in custom_code_problems("model.path", model)[0]  # deep: found
    for n in range(MAX_ENTRIES + 1):
        (model / f"filler_{n:05d}").touch()
    problems = custom_code_problems("model.path", model)
    assert problems and "more than 10000" in problems[0], problems
    with pytest.raises(ConfigError, match="more than 10000"):
        load_tokenizer(make_cfg(f"model.tokenizer_path={model}", check_files=False))


# ---------------------------------------------------------------------------------------------------------------
# A model directory choosing a quantizer through its config.json

QUANTIZED = [{"quantization_config": {"quant_method": "mxfp4"}},
             {"text_config": {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}}]


@pytest.mark.parametrize("values", QUANTIZED, ids=["mxfp4", "nested-bnb"])
def test_a_model_directory_cannot_choose_a_quantizer(values, model_dir, tmp_path, capsys, monkeypatch):
    """config.json `quantization_config` (or a sub-config's): transformers picks the quantizer its quant_method
    names and follows it; mxfp4 fetches kernels-community/triton_kernels with the installed `kernels` package where
    Triton and a GPU are there (here on CPU: a warning, then the weights 'dequantized'), bitsandbytes imports that
    package. Was: chat loaded it (exit 0); now one message naming the directory for chat, the rank's model load
    (train) and the reward model, before transformers reads the setting."""
    import torch

    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.errors import UserError
    from dsrecipes.modeling.model import load_pretrained
    from dsrecipes.objectives.rewards import load_reward_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _with_config(model_dir, tmp_path, **values)
    refused(capsys, ["chat", str(model), "--message", "hi", "--max-new-tokens", "2"], "is a quantized model")
    cfg = compose_and_load(["debug=fast", f"model.path={model}"])
    with pytest.raises(UserError, match="is a quantized model"):
        load_pretrained(cfg, torch.float32, None)
    with pytest.raises(UserError, match="is a quantized model"):
        load_reward_model(str(model), "cpu")


# ---------------------------------------------------------------------------------------------------------------
# A trusted checkpoint's contents: hash-consistent, hostile


def _load_with(monkeypatch, tmp_path, rng, state=None, train_state=None):
    """rank/checkpoint.load_checkpoint on one rank, DeepSpeed's engine and the checked files stubbed: `rng` is what
    rng/rank0.pt holds, `state` the data position (a real map-style loader's load_state_dict reads it)."""
    import json
    from contextlib import nullcontext
    from types import SimpleNamespace

    import torch.distributed as dist

    from dsrecipes.data.plan.epoch import Position, resume_point
    from dsrecipes.rank import checkpoint as ck

    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    checked = SimpleNamespace(guard=nullcontext, close=lambda: None, load=lambda *a, **k: rng,
                              read_bytes=lambda p: json.dumps(state or {}).encode(), record={"step": 8})
    train_state = {"step": 8} if train_state is None else train_state
    engine = SimpleNamespace(load_checkpoint=lambda *a, **k: ("x", {"train_state": train_state}))
    layout = SimpleNamespace(world_size=1, micro_batch_size=1, grad_accum=1)
    loader = SimpleNamespace(load_state_dict=lambda s: resume_point(Position(**s["position"]), layout) if s else None)
    point = SimpleNamespace(checked=checked, tag_dir=tmp_path / "step_8", load_dir=tmp_path, tag="step_8",
                            frozen_excluded=False, saved_world_size=1)
    return ck.load_checkpoint(engine, loader, point)


@pytest.mark.parametrize("torch_state", ["3 bytes", "float", "list"])
def test_a_trusted_checkpoints_rng_of_another_size_is_one_message(torch_state, monkeypatch, tmp_path):
    """rng/rank0.pt of a colleague's checkpoint (hashes consistent, weights-only loadable) whose torch generator
    state is 3 bytes, of another dtype, or a list. Was: torch.set_rng_state's RuntimeError (or a TypeError) traceback
    from the rank, exit 1; now one message naming the file."""
    import random

    import numpy as np
    import torch

    from dsrecipes.boundary.point_of_use import ChangedCheckpoint

    given = {"3 bytes": torch.zeros(3, dtype=torch.uint8), "float": torch.get_rng_state().float(), "list": [1, 2]}
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": given[torch_state]}
    assert _load_with(monkeypatch, tmp_path, {**rng, "torch": torch.get_rng_state()}) is not None  # as written
    with pytest.raises(ChangedCheckpoint, match="rng/rank0.pt: not as dsrecipes writes it"):
        _load_with(monkeypatch, tmp_path, rng)


BAD_POSITIONS = [{"epoch": -1}, {"offset": 10**30}, {"micro": 1.5}, {"grad_accum": 0}, {"micro": True}]


@pytest.mark.parametrize("bad", BAD_POSITIONS, ids=[next(iter(b)) + "=" + str(next(iter(b.values()))) for b in BAD_POSITIONS])
def test_a_trusted_checkpoints_absurd_data_position_is_one_message(bad, monkeypatch, tmp_path):
    """data_state/rank0.json with a negative epoch, an offset of 10**30, a fractional or boolean micro-batch count,
    grad_accum 0. Was: taken as the position (the epoch plan then indexed with it, or ZeroDivisionError traceback
    from samples_consumed); now one message naming the file."""
    import random

    import numpy as np
    import torch

    from dsrecipes.boundary.point_of_use import ChangedCheckpoint

    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    position = {"epoch": 0, "offset": 0, "micro": 0, "world_size": 1, "micro_batch_size": 1, "grad_accum": 1}
    assert _load_with(monkeypatch, tmp_path, rng, {"position": position}) is not None
    with pytest.raises(ChangedCheckpoint, match=r"rank0.json: not as dsrecipes writes it \(ValueError"):
        _load_with(monkeypatch, tmp_path, rng, {"position": {**position, **bad}})


BAD_TRAIN_STATES = [{"step": 10**30}, {"step": 7}, {"epoch": -1}, {"elapsed": float("nan")}, {"samples_seen": 2.5},
                    {"selection": {"best_value": "x"}}, {"selection": {"bad_evals": "1"}},
                    {"selection": {"earlier_stops": 5}}, {"selection": []}]


@pytest.mark.parametrize("bad", BAD_TRAIN_STATES, ids=[str(b)[:40] for b in BAD_TRAIN_STATES])
def test_a_trusted_checkpoints_absurd_train_state_is_one_message(bad, monkeypatch, tmp_path):
    """DeepSpeed client_state train_state with a step of 10**30 (the run 'ended' at once) or another step than its
    complete.json records, a negative epoch, NaN seconds, a fractional sample count, or a selection state of other
    types (a string best value or patience counter: a TypeError traceback at the first evaluation). Was: taken as
    the run's progress; now one message naming the checkpoint."""
    import random

    import numpy as np
    import torch

    from dsrecipes.boundary.point_of_use import ChangedCheckpoint

    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    good = {"step": 8, "epoch": 1, "samples_seen": 64, "elapsed": 3.5, "skipped_steps": 0,
            "selection": {"best_step": 4, "best_value": 1.25, "bad_evals": 1, "stopped": None,
                          "earlier_stops": [{"step": None, "reason": "early stopping"}]}}
    assert _load_with(monkeypatch, tmp_path, rng, train_state=good).step == 8
    with pytest.raises(ChangedCheckpoint, match=r"step_8: its train_state .*not as dsrecipes writes it \(ValueError"):
        _load_with(monkeypatch, tmp_path, rng, train_state={**good, **bad})


def test_a_shared_run_directorys_config_with_a_huge_number_is_one_message(model_dir, tmp_path, capsys):
    """A shared run directory's config.yaml holding a whole number of 5000 digits (past Python's 4300-digit
    conversion limit). Was: prompt-eval --baseline ended in a ValueError traceback (exit 1) from the YAML reader;
    now one message naming the file. The same reader refuses a FIFO there without waiting on it."""
    import os

    from dsrecipes.config.load import read_yaml_mapping
    from dsrecipes.core.errors import ConfigError

    run = tmp_path / "shared_run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer:\n  max_steps: " + "9" * 5000 + "\n", encoding="utf-8")
    refused(capsys, ["prompt-eval", "--baseline", str(run), "--finetuned", str(model_dir)],
            str(run / "config.yaml"), "4300 digits")
    os.mkfifo(tmp_path / "fifo.yaml")
    with pytest.raises(ConfigError, match="not a regular file"):
        read_yaml_mapping(tmp_path / "fifo.yaml")


def test_training_prompt_eval_generates_with_none_of_the_directorys_generation_settings(model_dir, tmp_path):
    """model.path's generation_config.json naming `cache_implementation: quantized` and four beams: transformers
    fills what generate() is not given from the model's generation config. Was: the training run's prompt-eval
    (rank/gen_eval.py) followed it, an ImportError traceback (optimum-quanto) in the rank, or that package imported
    where installed; now greedy with the default cache, and the directory's settings stay for the export."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsrecipes.rank.gen_eval import PromptEval

    hostile = tmp_path / "model"
    shutil.copytree(model_dir, hostile)
    settings = json.loads((hostile / "generation_config.json").read_text())
    settings.update(num_beams=4, cache_implementation="quantized")
    (hostile / "generation_config.json").write_text(json.dumps(settings))
    model = AutoModelForCausalLM.from_pretrained(hostile)
    plain = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(hostile)
    evaluate = PromptEval([], 0, 1, tokenizer, [tokenizer.eos_token_id or 0], 3, False)
    assert evaluate._answer(model, [1, 2, 3], "cpu") == evaluate._answer(plain, [1, 2, 3], "cpu")
    assert model.generation_config.cache_implementation == "quantized"


def test_validate_refuses_a_tokenizer_directory_that_names_its_own_code_as_train_does(tmp_path, capsys):
    """model.tokenizer_path=DIR whose tokenizer_config.json has `auto_map`: train and inspect-data refused it
    (core/tokenizer.load_tokenizer), validate said OK (run/preflight.check_tokenizer_dir looked for files only)."""
    import json
    import shutil

    from dsrecipes.core.paths import TINY_TOKENIZER_DIR

    tok = tmp_path / "tok"
    shutil.copytree(TINY_TOKENIZER_DIR, tok)
    config = json.loads((tok / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["auto_map"] = {"AutoTokenizer": ["tok.EvilTokenizer", None]}
    (tok / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    refused(capsys, ["validate", f"model.tokenizer_path={tok}"], "model.tokenizer_path", "its own Python code")
