"""A run started by an older dsrecipes, continued after an upgrade (run/legacy_keys.py, run/resume_contract.py).

The older run is made for real: a short run of this version trained as the older one did (the legacy value set on
its command line), then every key added since is taken out of its config.yaml and the checkpoint's copy, with the
checkpoint's record re-described and signed, exactly as the older version wrote them. The user then types the
command they typed before (without the new key) and the run goes on as it started.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import yaml

from dsrecipes.run.legacy_keys import LEGACY
from tests.conftest import in_process_environ, subprocess_env

REPO = Path(__file__).resolve().parents[1]
PREVIOUS = "5f0a12d"  # a release before objective.lr_scale and dataset.pairs_as (its runs lack both)

SFT = ["debug=fast", "trainer.grad_accum=2", "trainer.micro_batch_size=2", "trainer.save_every=2",
       "trainer.export=false", "trainer.report_to=[]", "trainer.log_every=1", "trainer.record_samples=true"]
DPO = ["objective=dpo", "dataset=sample_pairs", "dataset.max_samples=24", "dataset.val_size=0", "data.cutoff_len=128",
       "trainer.micro_batch_size=4", "trainer.log_every=1", "scheduler=constant", "scheduler.warmup_steps=0",
       "trainer.save_every=2", "trainer.export=false", "trainer.report_to=[]"]


def cli(*argv: str) -> Tuple[int, str]:
    from dsrecipes.cli import main

    out = io.StringIO()
    with in_process_environ(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's own exits
            code = exc.code
    return code, out.getvalue()


def train(ws: Path, *overrides: str) -> Tuple[int, str]:
    return cli(f"data.cache_dir={ws / 'cache'}", f"trainer.output_dir={ws / 'run'}", f"hydra.run.dir={ws / 'run'}",
               *overrides)


def _drop(config: Dict, dotted: str) -> None:
    """Take `dotted` out of `config` ("a.b[].c": out of every entry of the list a.b)."""
    where, _, inner = dotted.partition("[].")
    *parents, last = where.split(".")
    node = config
    for part in parents:
        node = node.get(part, {}) if isinstance(node, dict) else {}
    if inner:
        for entry in node.get(last) or []:
            entry.pop(inner, None)
    else:
        node.pop(last, None)


def as_older_version_wrote_it(run: Path) -> List[str]:
    """Remove every key added since the older version from the run's config.yaml and each checkpoint's copy, and
    record (re-describe and sign) the checkpoint as that version did. Returns the keys removed."""
    from dsrecipes.boundary.trust import sign
    from dsrecipes.core import manifest
    from dsrecipes.core.rundir import write_config

    removed = [row.key for row in LEGACY]
    for where in [run, *sorted((run / "checkpoints").glob("step_*"))]:
        config = yaml.safe_load((where / "config.yaml").read_text())
        for key in removed:
            _drop(config, key)
        config["dataset"].pop("split")  # a group the older version did not have at all
        write_config(where, config)
        if where != run:
            record = json.loads((where / "complete.json").read_text())
            assert "config.yaml" in record["files"]
            record["files"] = manifest.describe(where, skip=["complete.json"])
            with in_process_environ():
                (where / "complete.json").write_text(json.dumps(sign(record)))
    text = (run / "config.yaml").read_text()
    assert "loss_average" not in text and "lr_scale" not in text and "split:" not in text
    return removed


def saved(run: Path) -> Dict:
    return yaml.safe_load((run / "config.yaml").read_text())


def metrics(run: Path) -> Dict[int, Dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def snapshot(run: Path) -> Dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
            and not p.name.endswith(".lock")}


@pytest.mark.slow
def test_an_older_sft_run_resumes_with_the_same_command_as_it_started(tmp_path):
    """SFT before objective.loss_average trained as micro_batches: the same command continues it so (said in one
    line, written into config.yaml, which the rank reads), again on the next resume; export, chat and the ledger
    audit read the older run directory; naming the new default on the command line is refused, nothing written."""
    code, said = train(tmp_path, *SFT, "trainer.max_steps=2", "objective.loss_average=micro_batches")
    assert code == 0, said[-3000:]
    run = tmp_path / "run"
    as_older_version_wrote_it(run)

    code, said = cli("export", str(run), "--out", str(tmp_path / "export"))
    assert code == 0 and (tmp_path / "export" / "config.json").is_file(), said[-3000:]
    code, said = cli("chat", str(tmp_path / "export"), "--message", "hi", "--max-new-tokens", "4")
    assert code == 0, said[-3000:]

    before = snapshot(run)
    code, said = train(tmp_path, *SFT, "trainer.max_steps=4", "objective.loss_average=tokens")
    assert code == 2, said[-3000:]
    assert ("objective.loss_average: absent (this run started before the key existed and trained as micro_batches) "
            "-> tokens") in said, said[-3000:]
    assert "To resume it as it started, use: objective.loss_average=micro_batches in place of your own" in said
    assert "Traceback" not in said and snapshot(run) == before

    code, said = train(tmp_path, *SFT, "trainer.max_steps=4")
    assert code == 0, said[-3000:]
    assert ("as it started, with its values for settings added since: objective.loss_average=micro_batches"
            in said), said[-3000:]
    assert saved(run)["objective"]["loss_average"] == "micro_batches"
    assert "resuming from step 2" in said and set(metrics(run)) == {1, 2, 3, 4}, said[-3000:]

    code, said = train(tmp_path, *SFT, "trainer.max_steps=6")  # "train further" once more: still as it started
    assert code == 0 and "objective.loss_average=micro_batches" in said, said[-3000:]
    assert saved(run)["objective"]["loss_average"] == "micro_batches" and set(metrics(run)) == set(range(1, 7))

    code, said = cli("audit", "--ledger", str(run))
    assert code == 0, said[-3000:]


@pytest.mark.slow
def test_an_older_dpo_run_resumes_at_the_rate_it_trained_at(tmp_path, model_dir):
    """DPO of a pretrained model before objective.lr_scale trained at the model's rate (2e-05, unscaled). The same
    command now derives 2e-06 (x 0.1); the resume continues with objective.lr_scale=1.0 and the stored 2e-05, in
    config.yaml, the DeepSpeed JSON and the logged rate."""
    model = f"model.path={model_dir}"
    code, said = train(tmp_path, *DPO, model, "trainer.max_steps=2", "objective.lr_scale=1.0",
                       "dataset.mix_sample=true")  # named data was read with dataset.paths then (empty here)
    assert code == 0, said[-3000:]
    run = tmp_path / "run"
    assert saved(run)["optimizer"]["lr"] == 2e-5
    as_older_version_wrote_it(run)

    code, said = train(tmp_path, *DPO, model, "trainer.max_steps=4")
    assert code == 0, said[-3000:]
    assert ("settings added since: objective.lr_scale=1.0, dataset.mix_sample=true, optimizer.lr=2e-05 (the rate it "
            "trained at; with the new objective.lr_scale 0.1 this command would derive 2e-06)") in said, said[-3000:]
    assert "changed settings: trainer.max_steps: 2 -> 4\n" in said, said[-3000:]  # the rate is not a change
    config = saved(run)
    assert (config["optimizer"]["lr"], config["objective"]["lr_scale"]) == (2e-5, 1.0)
    assert json.loads((run / "ds_config.json").read_text())["optimizer"]["params"]["lr"] == 2e-5
    rates = {step: r["lr"] for step, r in metrics(run).items()}
    assert set(rates) == {1, 2, 3, 4} and all(v == pytest.approx(2e-5) for v in rates.values()), rates


def test_every_legacy_key_fills_and_compares_as_the_run_trained():
    """Unit level, on a composed config: a saved config without the keys compares equal once the legacy values are
    the new ones, and the continuation sets exactly the differing ones (a key the command line names stays)."""
    import copy

    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.typed import config_to_dict
    from dsrecipes.run import legacy_keys, resume_contract

    cfg = compose_and_load(["debug=fast"])
    older = config_to_dict(cfg)
    for row in LEGACY:
        _drop(older, row.key)
    older["dataset"].pop("split")
    refused, accepted = resume_contract.compare(older, config_to_dict(cfg))
    assert refused == ["objective.loss_average: absent (this run started before the key existed and trained as "
                       "micro_batches) -> tokens"] and accepted == []
    continued, changed = legacy_keys.continue_as_started(cfg, older, [])
    assert changed == ["objective.loss_average=micro_batches"]
    assert resume_contract.compare(older, config_to_dict(continued)) == ([], [])
    kept, changed = legacy_keys.continue_as_started(cfg, copy.deepcopy(older), ["objective.loss_average=tokens"])
    assert changed == [] and kept == cfg


@pytest.mark.slow
def test_a_dpo_run_of_a_previous_release_resumes_with_the_same_command(tmp_path, model_dir):
    """Not fabricated: the release before objective.lr_scale and dataset.pairs_as (git archive of it, run from its own
    tree) trains two DPO steps at the model's rate 2e-05; this version resumes it with the same command: the same
    prepared data (its key does not change with pairs_as at `refuse`, what that release read pairs as), at 2e-05."""
    if shutil.which("git") is None or subprocess.run(["git", "cat-file", "-e", f"{PREVIOUS}^{{commit}}"], cwd=REPO,
                                                     capture_output=True).returncode != 0:
        pytest.skip(f"needs the repository's history ({PREVIOUS})")
    old = tmp_path / "previous"
    old.mkdir()
    archive = subprocess.run(["git", "archive", PREVIOUS, "dsrecipes", "conf", "recipes"], cwd=REPO,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
    data = tmp_path / "data"  # outside both trees: the bundled sample's path differs between them
    data.mkdir()
    for name in ("dataset_info.json", "pairs.jsonl"):
        shutil.copy(REPO / "dsrecipes" / "assets" / "sample_data" / name, data / name)
    command = [*DPO, f"dataset.registry={data / 'dataset_info.json'}", f"model.path={model_dir}",
               f"data.cache_dir={tmp_path / 'cache'}", f"trainer.output_dir={tmp_path / 'run'}"]
    made = subprocess.run([sys.executable, "-m", "dsrecipes", *command, "trainer.max_steps=2"], cwd=tmp_path,
                          env=subprocess_env({"PYTHONPATH": str(old)}), capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, (made.stdout + made.stderr)[-3000:]
    run = tmp_path / "run"
    assert "lr_scale" not in (run / "config.yaml").read_text() and saved(run)["optimizer"]["lr"] == 2e-5

    code, said = cli(*command, "trainer.max_steps=4")
    assert code == 0, said[-3000:]
    assert "objective.lr_scale=1.0, optimizer.lr=2e-05" in said and "data: cache hit" in said, said[-3000:]
    rates = {step: r["lr"] for step, r in metrics(run).items()}
    assert set(rates) == {1, 2, 3, 4} and all(v == pytest.approx(2e-5) for v in rates.values()), rates


def test_pairs_as_at_refuse_leaves_the_data_identity_as_it_was():
    """dataset.pairs_as (and a source's, stamped from it) at `refuse` is left out of the preparation material, so
    caches and fingerprints of runs before the key stay; `chosen` prepares other data and changes it."""
    import dataclasses

    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.schema import PairsAs, SourceConfig
    from dsrecipes.data.prepare.cache import as_before

    cfg = compose_and_load(["debug=fast"])
    assert "pairs_as" not in as_before("dataset", cfg.dataset)
    assert "pairs_as" not in as_before("source", SourceConfig(name="a", pairs_as=PairsAs.refuse))
    chosen = dataclasses.replace(cfg.dataset, pairs_as=PairsAs.chosen)
    assert as_before("dataset", chosen)["pairs_as"] == "chosen"
    assert as_before("source", SourceConfig(name="a", pairs_as=PairsAs.chosen))["pairs_as"] == "chosen"


# The fields of each section the data's identity hashes, as of PREP_VERSION 5 (6d0a63e): the runs that can resume
# today were keyed with exactly these. A field added since must be left out of the material at the value those runs
# read their data as (data/prepare/cache.py AS_BEFORE), or every existing run's data is re-keyed and refused.
HASHED_FIELDS_RUNS_HAD = {
    "DatasetConfig": ("dataset", "name paths format columns roles max_samples sources registry use mix_sample "
                                 "val_size val_paths bad_rows max_bad_fraction max_row_bytes split"),
    "SourceConfig": ("source", "name paths format columns roles max_samples weight ranking share"),
    "TemplateConfig": (None, "name separator default_system train_eot_newline"),
    "ColumnsConfig": (None, "messages role content system tools id instruction input output history prompt chosen "
                            "rejected"),
    "SplitConfig": (None, "shares take pin"),
}


def test_a_field_added_to_a_hashed_section_keeps_the_identity_of_existing_runs_data():
    import dataclasses

    from dsrecipes.core import schema
    from dsrecipes.data.prepare.cache import AS_BEFORE

    for name, (section, had) in HASHED_FIELDS_RUNS_HAD.items():
        added = {f.name for f in dataclasses.fields(getattr(schema, name))} - set(had.split())
        unkept = sorted(added - set(AS_BEFORE.get(section) or {}))
        assert unkept == [], (f"{name}: {unkept} enter the data's identity (data/prepare/cache.py); give each an "
                              "AS_BEFORE entry (the value runs before it read their data as)")


@pytest.mark.slow
def test_a_requeued_older_run_is_replanned_as_it_started(tmp_path):
    """A Slurm requeue re-plans from the run's own config.yaml (run/requeue.py, no command line): read with the
    schema's defaults for the absent keys, it is continued with the legacy values all the same (write_run_dir writes
    what decide chose)."""
    from dsrecipes.run import requeue

    code, said = train(tmp_path, *SFT, "trainer.max_steps=2", "objective.loss_average=micro_batches")
    assert code == 0, said[-3000:]
    run = tmp_path / "run"
    as_older_version_wrote_it(run)
    from dsrecipes.core.rundir import write_config

    config = saved(run)
    config["trainer"]["max_steps"] = 4  # the job's budget; preempted after its checkpoint at step 2
    write_config(run, config)
    out = io.StringIO()
    with in_process_environ(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = requeue.main(["--run-dir", str(run)])
    assert code == 0, out.getvalue()[-3000:]
    assert "its values for settings added since: objective.loss_average=micro_batches" in out.getvalue()
    assert saved(run)["objective"]["loss_average"] == "micro_batches"
    assert json.loads((run / "plan.json").read_text())["resume"]["step"] == 2
