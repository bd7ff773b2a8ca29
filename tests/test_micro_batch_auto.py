"""trainer.micro_batch_size=auto (issue 46), everything a CPU can check: the search (doubling, then bisection) with a
fake out-of-memory, the probe's rows, the key's validation, the one-message refusal on a machine without a GPU
(also through `dsrecipes` itself and through the probe's own subprocess), and that a run directory's recorded value
wins over a new probe (what a resume relies on)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml

from dsrecipes.config.validate import check_runtime, micro_batch_problems
from dsrecipes.core.errors import UserError
from dsrecipes.core.schema import ObjectiveKind, RowKind, TrainConfig
from dsrecipes.objectives.sft import collate
from dsrecipes.rank.batch_probe import fits_unless_oom, largest_fitting, probe_rows
from dsrecipes.run import micro_batch
from tests.conftest import in_process_environ


def with_size(size, **trainer) -> TrainConfig:
    cfg = TrainConfig()
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_size=size, **trainer))


def test_search_doubles_then_bisects_to_the_largest_that_fits():
    size, tried = largest_fitting(lambda m: m <= 37, limit=256)
    assert size == 37
    assert [m for m, _ in tried] == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    assert [ok for _, ok in tried] == [True] * 6 + [False, False, False, True, False, True]


def test_search_stops_at_the_limit_and_when_one_row_does_not_fit():
    assert largest_fitting(lambda m: True, limit=100)[0] == 100
    assert [m for m, _ in largest_fitting(lambda m: True, limit=100)[1]] == [1, 2, 4, 8, 16, 32, 64, 100]
    assert largest_fitting(lambda m: True, limit=1) == (1, [(1, True)])
    assert largest_fitting(lambda m: False, limit=256) == (0, [(1, False)])


def test_out_of_memory_means_does_not_fit_and_is_cleaned_up_other_errors_propagate():
    cleaned = []

    def step(size: int) -> None:
        if size > 5:
            raise torch.OutOfMemoryError(f"CUDA out of memory (fake) at {size}")

    size, tried = largest_fitting(fits_unless_oom(step, lambda: cleaned.append(1)), limit=64)
    assert size == 5 and len(cleaned) == sum(not ok for _, ok in tried) == 2
    assert [m for m, _ in tried] == [1, 2, 4, 8, 6, 5]

    def broken(size: int) -> None:
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError):
        largest_fitting(fits_unless_oom(broken, lambda: None), limit=4)


@pytest.mark.parametrize("packing", [False, True])
def test_probe_rows_are_full_length_micro_batches(packing):
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, cutoff_len=16, packing=packing))
    batch = collate(probe_rows(cfg, 3, vocab=100), pad_id=0)
    assert tuple(batch["input_ids"].shape) == (3, 16) and batch["num_tokens"] == 48
    assert int(batch["input_ids"].max()) < 100 and len(batch["ids"]) == (6 if packing else 3)
    assert (batch["attention_mask"] is None) == packing


def test_the_probe_trains_the_runs_model_from_its_request(tmp_path):
    """The probe's own training step, on the CPU (the GPU-only parts are its memory checks): the request the
    launching side sends (config and one-rank DeepSpeed JSON) builds the run's model, engine and objective, and
    two optimizer steps of full-length rows run."""
    from dsrecipes.config.load import compose_and_load, from_dict
    from dsrecipes.core.distributed import init_distributed
    from dsrecipes.rank.batch_probe import STEPS, Trainer

    cfg = compose_and_load(["model=tiny", "precision=fp32", "trainer.device=cpu", "zero=stage2", "data.packing=true",
                            "data.cutoff_len=32", "trainer.micro_batch_size=auto", "trainer.grad_accum=4"],
                           check_files=False)
    request = json.loads(json.dumps(micro_batch.probe_request(cfg)))  # as it travels
    assert request["ds_config"]["train_micro_batch_size_per_gpu"] == 1
    assert request["ds_config"]["gradient_accumulation_steps"] == 1 and request["limit"] == micro_batch.LIMIT
    probe_cfg, errors = from_dict(request["config"])
    assert not errors and probe_cfg.trainer.micro_batch_size == 1 and probe_cfg.zero.stage == 2
    with in_process_environ():
        init_distributed()
        trainer = Trainer(probe_cfg, request["ds_config"])
        trainer.build()
        trainer.train(3)
    assert trainer.engine.global_steps == STEPS


def test_the_key_is_a_whole_number_or_auto_one_line_each():
    assert micro_batch_problems(with_size(4)) == [] and micro_batch_problems(with_size("auto")) == []
    for bad in ("big", 2.5, True, None):
        problems = micro_batch_problems(with_size(bad))
        assert len(problems) == 1 and problems[0].startswith("trainer.micro_batch_size: must be an integer >= 1 or "
                                                             "'auto'"), problems
    assert micro_batch_problems(with_size(0)) == ["trainer.micro_batch_size: must be >= 1, got 0"]
    cfg = with_size("auto")
    dpo = dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, kind=ObjectiveKind.dpo,
                                                                 rows=RowKind.pair))
    assert micro_batch_problems(dpo) == ["trainer.micro_batch_size: auto probes conversation rows (objective=sft), "
                                         "not objective=dpo's pair rows; set a number"]


def test_auto_without_a_gpu_is_one_message_naming_the_key():
    assert check_runtime(with_size(8), cuda_available=False) == []
    problems = check_runtime(with_size("auto"), cuda_available=False)
    assert len(problems) == 1 and problems[0].startswith("trainer.micro_batch_size: auto is a GPU-only choice")
    assert check_runtime(with_size("auto"), cuda_available=True) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a CUDA GPU")
def test_dsrecipes_refuses_auto_on_this_machine_before_writing_anything(tmp_path, capsys):
    from dsrecipes.cli import main

    run_dir = tmp_path / "run"
    with in_process_environ():
        code = main(["model=tiny", "trainer.micro_batch_size=auto", f"trainer.output_dir={run_dir}",
                     f"hydra.run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and not run_dir.exists()
    assert err.strip().splitlines() == ["error: trainer.micro_batch_size: auto is a GPU-only choice (a probe finds "
                                        "the largest micro-batch that fits GPU memory) and this machine has no CUDA "
                                        "GPU; set a number, e.g. trainer.micro_batch_size=8"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a CUDA GPU")
def test_the_probe_subprocess_speaks_its_protocol_and_refuses_without_a_gpu():
    with pytest.raises(UserError) as caught:
        micro_batch.run_probe(with_size("auto"))
    assert caught.value.problems == ["trainer.micro_batch_size: auto is a GPU-only choice and this machine has no "
                                     "CUDA GPU; set a number"]


def never(cfg):
    raise AssertionError("probed again although the run directory records its micro-batch")


def test_a_number_is_kept_and_auto_probes_once_then_the_record_wins(tmp_path, capsys):
    assert micro_batch.settle(with_size(8), tmp_path, probe=never).trainer.micro_batch_size == 8
    record = {"micro_batch_size": 24, "tried": [[1, True], [32, False], [24, True]], "device": "FakeGPU"}
    cfg = micro_batch.settle(with_size("auto"), tmp_path, probe=lambda c: record)
    assert cfg.trainer.micro_batch_size == 24 and cfg.trainer.grad_accum == 1
    assert json.loads((tmp_path / micro_batch.RECORD_FILE).read_text()) == record
    assert not list(tmp_path.glob("*.tmp*"))
    resumed = micro_batch.settle(with_size("auto", grad_accum=4), tmp_path, probe=never)  # a resume: no new probe
    assert resumed.trainer.micro_batch_size == 24 and resumed.trainer.grad_accum == 4
    out = capsys.readouterr().out
    assert "trainer.micro_batch_size=auto: 24 (the largest that fits one FakeGPU" in out
    assert f"trainer.micro_batch_size=auto: 24 (recorded in {tmp_path / micro_batch.RECORD_FILE})" in out


def test_a_run_without_a_record_keeps_the_number_its_config_yaml_ran_with(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"trainer": {"micro_batch_size": 16}}))
    assert micro_batch.settle(with_size("auto"), tmp_path, probe=never).trainer.micro_batch_size == 16


@pytest.mark.parametrize("text", ["{not json", json.dumps({"micro_batch_size": 0}), json.dumps({"other": 3})])
def test_a_broken_record_is_one_message_naming_the_file(tmp_path, text):
    (tmp_path / micro_batch.RECORD_FILE).write_text(text)
    with pytest.raises(UserError) as caught:
        micro_batch.settle(with_size("auto"), tmp_path, probe=never)
    assert len(caught.value.problems) == 1 and str(tmp_path / micro_batch.RECORD_FILE) in caught.value.problems[0]



@pytest.mark.parametrize("command", ["estimate", "show", "audit"])
def test_commands_that_need_the_number_say_so_in_one_message(command, capsys):
    from dsrecipes.cli import main

    with in_process_environ():
        code = main([command, "model=tiny", "trainer.micro_batch_size=auto"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().startswith("error: trainer.micro_batch_size: auto is found by a probe on the GPU"), err
