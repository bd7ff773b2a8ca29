"""Failures said once, tried for real first (helper live3): a pipeline stage that fails is one message naming its
cause, the stage and the pipeline's one resume command; ranks that cannot record their failure on a full disk say it
once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.test_redteam_live2 import small_disk  # noqa: F401  (fixture)


def test_a_stage_refused_by_train_is_one_message_with_its_cause_and_the_resume_command(tmp_path, monkeypatch,
                                                                                       capsys):
    """Tried for real ('dsrecipes pipeline p.yaml --out out', a stage's dataset.paths naming a file that is gone):
    'error: dataset.paths[0]: ... matches no file' (on stdout), then 'error: pipeline: stage 'sft' (1 of 1) failed
    (exit 2); its run directory: out/sft' (never made) '... resume with: ...'. Now the second line alone, with the
    cause."""
    from dsrecipes.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text("stages:\n  - name: sft\n    set: {dataset.paths: [gone.jsonl]}\n  - name: b\n")
    code = main(["pipeline", "p.yaml", "--out", "out"])
    out, err = capsys.readouterr()
    command = f"cd {tmp_path} && {sys.executable} -m dsrecipes pipeline p.yaml --out out"
    assert code == 2 and "error:" not in out and err.count("error:") == 1 and err.count("\n") == 1, (out, err)
    assert err.startswith("error: pipeline: stage 'sft' (1 of 2) failed (exit 2): dataset.paths[0]: "), err
    assert "matches no file; it wrote nothing; " in err and err.rstrip().endswith(f"resume with: {command}"), err


def test_a_stage_whose_rank_failed_is_one_message_with_its_cause_and_the_resume_command(tmp_path, monkeypatch,
                                                                                        capsys):
    """A stage whose rank failed (its report in failure.json, read by the launching process: commands/outcome): was
    'error: rank 0 failed: ValueError: ...' and '  full traceback: ...' from the stage, then the pipeline's 'error:
    pipeline: stage ... failed (exit 1) ...'. Now one message."""
    import dsrecipes.commands.train as train
    from dsrecipes.cli import main
    from dsrecipes.commands.outcome import conclude
    from dsrecipes.core.failure import record_rank_failure

    def stage(argv):  # the training command whose rank 0 failed, as commands/train._launch ends it
        run_dir = Path(next(a for a in argv if a.startswith("trainer.output_dir=")).partition("=")[2])
        (run_dir / "logs").mkdir(parents=True)
        try:
            raise ValueError("the shard is corrupt")
        except ValueError as exc:
            record_rank_failure(run_dir, 0, exc, run_dir / "logs" / "rank0.log")
        return conclude(run_dir, 1, False, argv)[0]

    monkeypatch.setattr(train, "main", stage)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.yaml").write_text("stages:\n  - name: sft\n  - name: dpo\n    model_from: sft\n")
    code = main(["pipeline", "p.yaml", "--out", "out"])
    out, err = capsys.readouterr()
    command = f"cd {tmp_path} && {sys.executable} -m dsrecipes pipeline p.yaml --out out"
    assert code == 2 and err.count("error:") == 1 and err.count("\n") == 1, err
    assert err.startswith("error: pipeline: stage 'sft' (1 of 2) failed (exit 1): rank 0 failed: ValueError: the "
                          "shard is corrupt"), err
    assert f"(full traceback: {tmp_path / 'out' / 'sft' / 'logs' / 'rank0.log'}); its run directory: " in err, err
    assert err.rstrip().endswith(f"resume with: {command}"), err


@pytest.fixture
def full_disk(small_disk):  # noqa: F811
    """A run directory on a 1 MiB tmpfs filled to the last byte (root only: skipped otherwise)."""
    run_dir, fill = small_disk
    fill()
    return run_dir


class GoneStore:
    def set_timeout(self, timeout):
        pass

    def add(self, key, amount):
        raise RuntimeError("Connection reset by peer")  # as torch's TCPStore says it when its host ended


@pytest.mark.parametrize("store", ["shared", "gone"])
def test_ranks_that_cannot_record_their_failure_on_a_full_disk_say_it_once(full_disk, monkeypatch, capsys, store):
    """Tried for real (2 ranks, launcher=deepspeed on CPU/gloo, the run directory on a 60 MiB tmpfs filled by dd at
    step 6): 'error: rank 0 failed: OSError: [Errno 28] ... (at dsrecipes/observe/metrics.py:140) (the disk of RUN is
    full: ...)' and then 'error: rank 1 failed: RuntimeError: [.../gloo/transport/tcp/pair.cc:553] Connection closed
    by peer ... (the disk of RUN is full: ...)', each rank its own line. Now the first rank to count itself in the
    job's store says it; a store that is gone (its host, rank 0, ended after saying its own) says a rank did."""
    import errno
    from types import SimpleNamespace

    import torch.distributed as dist

    import dsrecipes.core.heartbeat as heartbeat
    import dsrecipes.rank.worker as worker
    from dsrecipes.commands.outcome import conclude

    beat = SimpleNamespace(world_size=2, run_dir=full_disk, prefix="dsrecipes/heartbeat/0",
                           store=dist.HashStore() if store == "shared" else GoneStore())
    monkeypatch.setattr(heartbeat, "stopped", lambda: beat)
    monkeypatch.setattr(worker, "end_workers", lambda: None)
    failures = {"0": OSError(errno.ENOSPC, "No space left on device"),
                "1": RuntimeError("Connection closed by peer [127.0.0.1]:17090")}
    for rank, exc in failures.items():
        monkeypatch.setenv("RANK", rank)
        assert worker.failed(full_disk, exc) == 1
    assert conclude(full_disk, 1, False, []) == (1, False)
    err = capsys.readouterr().err
    if store == "gone":  # neither rank could count itself: rank 0, the store's host, said it before it ended
        assert err == "", err
        return
    assert err.count("\n") == 1 and err.startswith("error: rank 0 failed: OSError: [Errno 28]"), err
    assert f"the disk of {full_disk} is full" in err and "(no checkpoint yet: it starts from step 1)" in err


def test_a_stage_whose_data_file_is_corrupt_is_one_message_with_its_cause(tmp_path, monkeypatch, capsys):
    """Tried for real (a stage's data file whose second row is cut short): 'error: .../bad.jsonl:2: invalid_json
    (...)' from the stage's run (commands/train._record), then the pipeline's 'error: pipeline: stage ... failed
    (exit 2) ...'. Now one message."""
    from dsrecipes.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
                                        '"content": "yo"}]}\n{"messages": [{"role": "user", "content": "hi"\n')
    (tmp_path / "p.yaml").write_text("stages:\n  - name: sft\n    set: {debug: fast, dataset: openai_messages, "
                                     f"dataset.paths: [{tmp_path / 'bad.jsonl'}]}}\n")
    code = main(["pipeline", "p.yaml", "--out", "out"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1, err
    assert f"error: pipeline: stage 'sft' (1 of 1) failed (exit 2): {tmp_path / 'bad.jsonl'}:2: invalid_json" in err
    assert err.rstrip().endswith(f"resume with: cd {tmp_path} && {sys.executable} -m dsrecipes pipeline p.yaml --out out")


def _save_on_a_disk_rank0_finds_full(rank: int, port: int, run_dir: str, said: dict) -> None:
    """A rank of a 2-process gloo group saving a checkpoint through an engine that saves as DeepSpeed's does (a
    barrier, the rank's files, a closing barrier) and on rank 0 runs out of space in between."""
    import errno
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dsrecipes.core.disk_space import OutOfSpace
    from dsrecipes.rank.checkpoint import TrainState, save_checkpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))  # the old code: a hang, then gloo's timeout

    class Engine:
        module = torch.nn.Linear(1, 1)

        def save_checkpoint(self, save_dir, tag, **kwargs):
            dist.barrier()
            if rank == 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            dist.barrier()

    class Loader:
        def state_dict(self):
            return {"epoch": 0}

    try:
        save_checkpoint(Engine(), Loader(), TrainState(step=8), Path(run_dir), 2, frozen_excluded=False, record={})
    except OutOfSpace as exc:
        said[rank] = str(exc)
    except Exception as exc:  # noqa: BLE001 - what the parent reports
        said[rank] = f"{type(exc).__name__}: {exc}"
    dist.destroy_process_group()


def test_a_rank_whose_disk_fills_inside_deepspeeds_save_does_not_hang_the_others(tmp_path):
    """Tried for real (2 ranks, launcher=deepspeed on CPU/gloo, save_every=4, the run directory on a 30 MiB tmpfs
    filled at step 5 to 2 MiB free): rank 0 ran out of space writing step_8 inside DeepSpeed's save_checkpoint and went
    on to rank/checkpoint._stop_if_full's all_reduce, while rank 1 waited in DeepSpeed's closing barrier: both hung
    (gdb), 'dsrecipes: waiting 120 s: rank 0 ... phase checkpoint' until launcher.stall_timeout_s (30 minutes). Now
    the rank takes its place in that barrier and both end with 628456a's one OutOfSpace message."""
    import torch.multiprocessing as mp

    from dsrecipes.core.distributed import free_port

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    with mp.Manager() as manager:
        said = manager.dict()
        mp.start_processes(_save_on_a_disk_rank0_finds_full, args=(free_port(), str(run_dir), said), nprocs=2,
                           join=True, start_method="spawn")
        said = dict(said)
    expected = f"checkpoint: out of disk space writing {run_dir / 'checkpoints' / 'step_8'}"
    assert sorted(said) == [0, 1] and all(m.startswith(expected) for m in said.values()), said
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == []  # the partial checkpoint removed


def test_a_heartbeat_that_cannot_record_a_lost_store_on_a_full_disk_ends_without_a_traceback(full_disk,
                                                                                              monkeypatch):
    """Tried for real (the 2-rank dd run above): rank 1's heartbeat thread, finding the job's store gone with rank 0,
    printed 'Exception in thread dsrecipes-heartbeat: Traceback ... core/failure.py ... write_failure ... OSError:
    [Errno 28]' (Heartbeat._fail let write_failure's error escape). Now it ends the rank as it would have."""
    import dsrecipes.core.heartbeat as heartbeat
    import dsrecipes.core.stall as stall

    def exit_thread(code):
        raise SystemExit(code)

    monkeypatch.setattr(heartbeat.os, "_exit", exit_thread)
    beat = heartbeat.Heartbeat(full_disk, 1, 2, 30, stall.Watch(0, 0))
    with pytest.raises(SystemExit) as ended:  # before: OSError [Errno 28] out of the heartbeat's thread
        beat._fail([], "the job's store at 127.0.0.1:1 stopped answering (DistNetworkError)")
    assert ended.value.code == heartbeat.PEER_LOST_EXIT


def test_a_stage_model_refused_for_trust_names_a_command_that_takes_the_flag(tmp_path, monkeypatch, capsys):
    """The pipeline's prompt answers load each stage's export; a refusal (an export this user did not sign) says
    "repeat with `RETRY --trust-checkpoint PATH`". RETRY was `dsrecipes pipeline ... --out DIR`, which has no such
    flag (trust is never carried between stages): the printed command failed with 'unrecognized arguments'. It is now
    prompt-eval on that stage, which takes it."""
    import shlex

    import dsrecipes.serve.pipeline_prompts as pipeline_prompts
    from dsrecipes.cli import main
    from dsrecipes.core.errors import UserError

    seen = []

    def refuse(path, **kwargs):
        seen.append(kwargs["retry"])
        raise UserError("refusing to load this export")

    monkeypatch.setattr(pipeline_prompts, "resolve_model_path", refuse)
    stage = tmp_path / "sft"
    stage.mkdir()
    with pytest.raises(UserError):
        pipeline_prompts.answer_stages(tmp_path, [("sft", stage)], 2, 4)
    argv = shlex.split(seen[0])[1:] + ["--trust-checkpoint", str(stage)]
    capsys.readouterr()
    assert main(argv) == 2  # no run there: refused for that, not for its arguments
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err and str(stage) in err, err
