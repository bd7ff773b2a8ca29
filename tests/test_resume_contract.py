"""The resume contract's table (dsrecipes/run/resume_contract.py) and the pieces of run-directory safety that need no
training: every setting is classified, checkpoint records verify, atomic claims, locks, stop signals."""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path

import pytest

from dsrecipes.core.schema import TrainConfig
from dsrecipes.core.typed import config_to_dict
from dsrecipes.run import resume_contract


def leaf_keys() -> list:
    return sorted(resume_contract.flatten(config_to_dict(TrainConfig())))


def test_every_setting_is_classified():
    keys = leaf_keys()
    assert len(keys) > 100
    unlisted = [k for k in keys if not resume_contract.listed(k)]
    assert not unlisted, f"decide whether a resume may change these (resume_contract.py): {unlisted}"


def test_what_the_issue_lists_must_match_and_what_it_allows_may_change():
    must = ["model.path", "model.lora.enabled", "model.lora.r", "optimizer.name", "template.name", "data.cutoff_len",
            "data.packing", "trainer.seed", "dataset.paths", "model.tiny.hidden_size"]
    may = ["trainer.max_steps", "trainer.epochs", "trainer.save_every", "trainer.eval_every", "trainer.log_every",
           "data.num_workers", "launcher.kind", "launcher.num_gpus", "launcher.num_nodes", "model.name"]
    assert [k for k in must if resume_contract.may_change(k)] == []
    assert [k for k in may if not resume_contract.may_change(k)] == []
    assert not resume_contract.may_change("trainer.some_future_key")  # unknown: unsafe until classified


def test_compare_and_fingerprint():
    old = config_to_dict(TrainConfig())
    cfg = TrainConfig()
    new = config_to_dict(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=9, seed=1)))
    refused, accepted = resume_contract.compare(old, new)
    assert refused == ["trainer.seed: 42 -> 1"] and accepted == ["trainer.max_steps: 400 -> 9"]
    assert resume_contract.identity_fingerprint(old) != resume_contract.identity_fingerprint(new)
    only_budget = config_to_dict(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=9)))
    assert resume_contract.identity_fingerprint(old) == resume_contract.identity_fingerprint(only_budget)


def test_a_manifest_catches_truncation_and_same_size_rewrites(tmp_path):
    from dsrecipes.core import manifest

    (tmp_path / "sub").mkdir()
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(range(256)) * (6 << 12))  # 6 MiB: hashed by windows
    (tmp_path / "sub" / "small.json").write_text('{"a": 1}')
    files = manifest.describe(tmp_path)
    assert manifest.verify(tmp_path, files) is None
    (tmp_path / "sub" / "small.json").write_text('{"a": 2}')
    assert manifest.verify(tmp_path, files) == "sub/small.json: content differs from when it was written"
    (tmp_path / "sub" / "small.json").write_text('{"a": 1}')
    with open(big, "r+b") as fh:
        fh.seek(0)
        fh.write(b"\xff")
    assert manifest.verify(tmp_path, files) == "big.bin: content differs from when it was written"
    big.unlink()
    assert manifest.verify(tmp_path, files) == "big.bin: missing"


def test_claims_take_a_new_or_empty_directory_or_our_own(tmp_path):
    from dsrecipes.core.errors import UserError
    from dsrecipes.core.rundir import MARKER_FILE, claim, unique_new_dir

    with claim(tmp_path / "new", "k", "fp") as held:
        assert held.fresh and json.loads((tmp_path / "new" / MARKER_FILE).read_text())["config_fingerprint"] == "fp"
        with pytest.raises(UserError, match="in use by another run: pid"):
            claim(tmp_path / "new", "k", "fp")
    with claim(tmp_path / "new", "k", "fp") as again:
        assert not again.fresh
    (tmp_path / "empty").mkdir()
    claim(tmp_path / "empty", "k", "fp").release()
    base = tmp_path / "outputs" / "10-00-00"
    assert [unique_new_dir(base).name for _ in range(3)] == ["10-00-00", "10-00-00-1", "10-00-00-2"]


def test_stop_signals_are_recorded_and_a_second_ctrl_c_stops_at_once():
    import os

    from dsrecipes.core import stopping

    seen = []
    stopping.reset()
    with stopping.handling(on_signal=seen.append):
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopping.requested() == signal.SIGTERM and seen == [signal.SIGTERM]
        time.sleep(1.2)  # a SIGINT within a second of the first signal counts as the same interruption (issue 22)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))
    stopping.reset()


def test_the_slurm_example_requeues_and_signals_before_the_time_limit():
    text = (Path(__file__).resolve().parents[1] / "launch" / "slurm_example.sbatch").read_text()
    assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@" in text
    assert "scontrol requeue" in text and "RUN_DIR=${RUN_DIR:-$PWD/outputs/slurm-$SLURM_JOB_ID}" in text
