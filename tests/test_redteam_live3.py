"""Failures said once, tried for real first (helper live3): a pipeline stage that fails is one message naming its
cause, the stage and the pipeline's one resume command."""

from __future__ import annotations

import sys
from pathlib import Path


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
