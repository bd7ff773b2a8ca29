"""A real tiny pipeline for the `dsrecipes audit --ledger PIPELINE_OUT` tests (tests/test_audit_pipeline.py,
tests/test_review_today.py): SFT, then a reward model and DPO on two shares of the bundled pairs file, every stage
recording its ledger. Run once per test session and worker (tests/conftest.py `split_pipeline_out`); each test
audits a copy (`copy_of`), edited as a wrong pipeline would have written it."""

from __future__ import annotations

import shutil
from pathlib import Path

PIPELINE = """\
shared:
  debug: fast
  data.cutoff_len: 256
  dataset: {max_samples: 16, val_size: 0}
  trainer: {save_every: 0, eval_every: 0, max_steps: 2, micro_batch_size: 2, record_samples: true,
            export: true}
stages:
  - name: sft
  - name: reward
    model_from: sft
    set:
      objective: reward
      dataset: sample_pairs
      dataset.split.shares: {reward: 1, dpo: 1}
      dataset.split.take: reward
  - name: dpo
    model_from: sft
    set:
      objective: dpo
      dataset: sample_pairs
      dataset.split.shares: {reward: 1, dpo: 1}
      dataset.split.take: dpo
      trainer.export: false
"""


def run_pipeline(base: Path) -> Path:
    from dsrecipes.cli import main
    from tests.conftest import in_process_environ

    path, out = base / "p.yaml", base / "out"
    path.write_text(PIPELINE)
    with in_process_environ():
        assert main(["pipeline", str(path), "--out", str(out)]) == 0
    return out


def audit(out: Path, capsys) -> tuple:
    """(exit code, captured output) of `dsrecipes audit --ledger out`, in this process."""
    from dsrecipes.cli import main
    from tests.conftest import in_process_environ

    capsys.readouterr()
    with in_process_environ():
        code = main(["audit", "--ledger", str(out)])
    return code, capsys.readouterr()


def copy_of(out: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "out"
    shutil.copytree(out, copy, symlinks=True)
    return copy


def edit_config(run: Path, **split) -> None:
    """The stage's config.yaml with dataset.split replaced, as a pipeline run with that split would have written it."""
    import yaml

    path = run / "config.yaml"
    config = yaml.safe_load(path.read_text())
    config["dataset"]["split"] = {"shares": {}, "take": None, "pin": {}, **split}
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def point_at_a_copy(out: Path, tmp_path: Path, stages=("reward", "dpo")) -> Path:
    """The stages' registry moved to a copy in tmp_path/data (returned), their plan.json recording the bundled
    pairs file's hash for the copy's pairs.jsonl, as if they had trained on it; the copy's pairs.jsonl is not
    written here (each test makes it what it needs: shorter, gone, a FIFO)."""
    import json

    from dsrecipes.core.paths import ASSETS_DIR

    data, registry = tmp_path / "data", ASSETS_DIR / "sample_data" / "dataset_info.json"
    data.mkdir()
    shutil.copy(registry, data)
    original = ASSETS_DIR / "sample_data" / "pairs.jsonl"
    for stage in stages:
        path = out / stage / "config.yaml"
        path.write_text(path.read_text().replace(str(registry), str(data / "dataset_info.json")))
        plan = json.loads((out / stage / "plan.json").read_text())
        plan["data_files"] = {str(data / "pairs.jsonl"): plan["data_files"][str(original)]}
        (out / stage / "plan.json").write_text(json.dumps(plan))
    return data
