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


# Every leaf key of TrainConfig when runs already existed (2026-12-05, 998832a), by section: a key added since is
# absent from those runs' config.yaml, so one that must match on resume needs a legacy row (legacy_keys.LEGACY).
KEYS_RUNS_HAD = {
    "data": "block_bytes cache_dir chunk_bytes cutoff_len kind num_samples num_workers packing prefetch_factor "
            "preprocess_workers prescan read_ahead_bytes shard_dir shuffle shuffle_buffer span_bytes train_on",
    "dataset": "bad_rows columns.chosen columns.content columns.history columns.id columns.input columns.instruction "
               "columns.messages columns.output columns.prompt columns.rejected columns.role columns.system "
               "columns.tools format max_bad_fraction max_row_bytes max_samples name paths registry roles sources use "
               "val_paths val_size",
    "launcher": "dry_run env exclude extra_args hostfile include kind master_addr master_port node_rank num_gpus "
                "num_nodes peer_timeout_s rdzv_endpoint slurm_account slurm_conda_env slurm_modules slurm_partition "
                "slurm_sbatch_args slurm_time_min slurm_venv",
    "model": "arch attn_implementation finetune_lr gradient_checkpointing lora.alpha lora.dropout lora.enabled "
             "lora.finetune_lr lora.only_optimize_lora lora.r lora.target_modules name num_params path revision "
             "tiny.finetune_lr tiny.hidden_size tiny.intermediate_size tiny.max_position_embeddings "
             "tiny.num_attention_heads tiny.num_hidden_layers tiny.num_key_value_heads tiny.seed "
             "tiny.tie_word_embeddings tokenizer_path trust_remote_code",
    "objective": "beta kind label_smoothing loss reference simpo_gamma",
    "offload": "nvme_path optimizer param pin_memory",
    "optimizer": "betas eps lr momentum name torch_adam weight_decay",
    "precision": "dtype initial_scale_power loss_scale loss_scale_window",
    "scheduler": "min_lr_ratio name warmup_steps",
    "template": "default_system name separator",
    "trainer": "device early_stopping.min_delta early_stopping.patience epochs eval_at_start eval_batches eval_every "
               "eval_samples experiment export export_merged_lora grad_accum gradient_clipping keep_checkpoints "
               "log_every max_steps micro_batch_size nan_max_skips nan_policy output_dir prompt_eval_every "
               "prompt_eval_max_new_tokens prompt_eval_samples record_samples report_to resume resume_from "
               "save_best.enabled save_best.metric save_best.mode save_every seed stop_grace_s tracking_uri",
    "zero": "allgather_bucket_size contiguous_gradients overlap_comm reduce_bucket_size stage "
            "stage3_gather_16bit_weights_on_model_save stage3_max_live_parameters stage3_param_persistence_threshold "
            "stage3_prefetch_bucket_size",
}
SOURCE_KEYS_RUNS_HAD = "name paths format columns roles max_samples weight ranking".split()  # dataset.sources[]


def test_every_legacy_key_is_a_schema_key_with_a_legacy_value_the_schema_takes():
    from dsrecipes.config.load import from_dict
    from dsrecipes.core.schema import SourceConfig
    from dsrecipes.run.legacy_keys import LEGACY, legacy_value

    schema = set(leaf_keys()) | {"dataset.split.shares", "dataset.split.pin"}  # mappings: no leaf when empty
    sources = {f"dataset.sources[].{f.name}" for f in dataclasses.fields(SourceConfig)}
    rows = [row.key for row in LEGACY]
    assert len(rows) == len(set(rows)) and rows
    assert [k for k in rows if k not in schema | sources] == [], "legacy_keys.LEGACY names keys the schema lacks"
    for row in LEGACY:
        if "[]." in row.key:
            continue
        data = config_to_dict(TrainConfig())
        *parents, last = row.key.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[last] = legacy_value(row, {"objective": {"kind": "dpo"}})
        assert from_dict(data)[1] == [], row.key


def test_a_key_added_since_runs_existed_that_must_match_has_a_legacy_value():
    """A new setting is a decision about the runs that already exist: what they trained as (legacy_keys.py)."""
    from dsrecipes.core.schema import SourceConfig
    from dsrecipes.run.legacy_keys import LEGACY

    had = {f"{section}.{key}" for section, keys in KEYS_RUNS_HAD.items() for key in keys.split()}
    assert len(had) == 160
    legacy = {row.key for row in LEGACY}
    added = [k for k in leaf_keys() if k not in had and not resume_contract.may_change(k) and k not in legacy]
    assert added == [], f"say in run/legacy_keys.py LEGACY what runs started before these keys trained as: {added}"
    added = [f"dataset.sources[].{f.name}" for f in dataclasses.fields(SourceConfig)
             if f.name not in SOURCE_KEYS_RUNS_HAD and f"dataset.sources[].{f.name}" not in legacy]
    assert added == [], f"say in run/legacy_keys.py LEGACY what runs started before these keys trained as: {added}"


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
