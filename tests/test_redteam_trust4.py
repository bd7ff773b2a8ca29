"""Trusting a checkpoint or export, fourth round: the commands around a run must carry the one decision the user made
on train's command line (`--trust-checkpoint PATH`) exactly where they load what it covers, and the ranks, which
have no command line, must check a reward model export where they load it (boundary/trust.py)."""

from __future__ import annotations

import json
import shlex

import pytest

from dsrecipes.boundary import trust
from dsrecipes.cli import main as cli_main
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.export_dir import EXPORT_MARKER
from tests.test_grpo import GRPO
from tests.test_messages_hostile import refused
from tests.test_redteam_live2 import signed_reward  # noqa: F401 (a fixture)


@pytest.fixture
def foreign_reward(signed_reward, tmp_path, monkeypatch):  # noqa: F811
    """An objective=reward export signed with another user's key: this user (a key of their own) must trust it."""
    model, _ = signed_reward
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "this_users_key"))
    trust.ensure_key()
    yield model.resolve()
    trust.reset()


def test_validate_takes_trust_checkpoint_as_train_does(foreign_reward, capsys):
    # Was: `dsrecipes validate` checks objective.reward_model as train does (signature included) and refused an
    # export signed by another user, but had no --trust-checkpoint: 'unrecognized arguments', so a user could train
    # (`dsrecipes train ... --trust-checkpoint PATH`) what they could not validate.
    argv = ["validate", *GRPO, f"objective.reward_model={foreign_reward}"]
    refused(capsys, argv, "refusing to load this export", f"`dsrecipes validate ... --trust-checkpoint {foreign_reward}`")
    assert cli_main([*argv, "--trust-checkpoint", str(foreign_reward)]) == 0
    assert cli_main([*argv, f"--trust-checkpoint={foreign_reward}"]) == 0
    refused(capsys, argv, "refusing to load this export")  # one command's decision, never carried over
    refused(capsys, [*argv, "--trust-checkpoint="], "--trust-checkpoint")  # an empty PATH trusts nothing


def _launched_with_trust(model, run_dir):
    """What train's launching process does with `--trust-checkpoint MODEL`: the reward model is checked with the
    config (objectives/rewards.reward_model_problems), accepted only because the command line trusted it."""
    from dsrecipes.objectives.rewards import reward_model_problems

    trust.reset()
    trust.trust([str(model)])
    assert reward_model_problems(str(model)) == []
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_2" / "complete.json").write_text("{}", encoding="utf-8")  # this run's own


def test_the_printed_resume_commands_repeat_the_trust_the_reward_model_needs(foreign_reward, tmp_path, capsys):
    # Was (tried: a 2-step GRPO run with objective.reward_model=another user's export --trust-checkpoint EXPORT):
    # the closing summary's `train further:` command, and the one printed on an interruption, left the flag out
    # (cli.py takes it off train's arguments), so copied they failed: 'refusing to load this export'.
    from dsrecipes.commands.outcome import resume_command as interrupted_command
    from dsrecipes.observe.report import resume_command

    run_dir = tmp_path / "run"
    overrides = [*GRPO, f"objective.reward_model={foreign_reward}"]
    _launched_with_trust(foreign_reward, run_dir)
    further = shlex.split(resume_command(run_dir, overrides, 2, 2))
    again = shlex.split(interrupted_command(run_dir, overrides, keep_resume_from=False).split(" && ", 1)[1])
    trust.reset()  # the printed command is a new invocation
    assert further[-2:] == again[-2:] == [trust.FLAG, str(foreign_reward)]
    assert further.count(trust.FLAG) == again.count(trust.FLAG) == 1
    # its refusal path (the config check the printed train command makes first) passes: validate takes its words
    assert cli_main(["validate", *further[1:]]) == 0, capsys.readouterr().err
    assert cli_main(["validate", *further[1:-2]]) == 2  # without the flag: refused, as it was


def test_the_flag_is_repeated_only_where_the_printed_command_loads_what_it_covers(tmp_path, monkeypatch):
    # A run continued from another user's checkpoint (trainer.resume_from=OTHER --trust-checkpoint OTHER) resumes
    # from its own signed checkpoint next time: no flag, and no trainer.resume_from (was: kept, so the printed
    # command was refused: 'trainer.resume_from: OTHER belongs to another run, but RUN already holds a run').
    from dsrecipes.boundary.checkpoint_find import trust_to_repeat
    from dsrecipes.observe.report import resume_command

    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "key"))
    other, run_dir = tmp_path / "other", tmp_path / "run"
    theirs = other / "checkpoints" / "step_4"
    theirs.mkdir(parents=True)
    trust.reset()
    trust.trust([str(other)])
    try:
        assert trust.check({"step": 4}, theirs, "checkpoint", "x") is False  # accepted because trusted
        assert trust_to_repeat(run_dir, keeps_resume_from=True) == [trust.FLAG, str(other.resolve())]  # nothing saved
        ours = run_dir / "checkpoints" / "step_6"
        ours.mkdir(parents=True)
        (ours / "complete.json").write_text("{}", encoding="utf-8")
        assert trust_to_repeat(run_dir, keeps_resume_from=False) == []
        printed = resume_command(run_dir, [f"trainer.resume_from={theirs}", "trainer.max_steps=8"], 8, 8)
        assert "trainer.resume_from" not in printed and trust.FLAG not in printed, printed
    finally:
        trust.reset()
    assert trust_to_repeat(run_dir, keeps_resume_from=True) == []  # nothing trusted: nothing to repeat


def _swap_record(model, **change):
    """Another user's export put in the place of the one checked: its own record, hashes as they are."""
    marker = model / EXPORT_MARKER
    record = json.loads(marker.read_text(encoding="utf-8"))
    record.pop(trust.SIGNATURE)
    marker.write_text(json.dumps({**record, **change}), encoding="utf-8")


def test_a_rank_loads_a_reward_model_only_as_its_launching_process_accepted_it(foreign_reward, tmp_path):
    # Was (tried: a GRPO run with --trust-checkpoint EXPORT; after plan.json was written, EXPORT's record replaced by
    # an unsigned one): the rank loaded the swapped export (objectives/rewards.load_reward_model checked the files
    # only, `signed=False`; its config check trusted the PATH in process), exit 0. And with launcher=deepspeed (ranks
    # in their own processes, no command line) the trusted export itself was refused on every rank.
    from dsrecipes.objectives.rewards import load_reward_model, reward_model_problems

    _launched_with_trust(foreign_reward, tmp_path / "run")
    pins = trust.accepted_exports()
    assert pins == {str(foreign_reward): trust.record_pin(json.loads((foreign_reward / EXPORT_MARKER).read_text()))}
    trust.reset()  # a rank of its own: no command line
    with trust.launched(pins):
        assert reward_model_problems(str(foreign_reward)) == []  # its config check, as the launch accepted it
        assert load_reward_model(str(foreign_reward), "cpu")
        _swap_record(foreign_reward, note="swapped in after the launch checked it")
        with pytest.raises(ConfigError, match="not the record the launching process checked"):
            load_reward_model(str(foreign_reward), "cpu")
        trust.trust([str(foreign_reward)])  # in the launching process's own (launcher=local): still refused
        assert "not the record the launching process checked" in reward_model_problems(str(foreign_reward))[0]
        (foreign_reward / EXPORT_MARKER).unlink()  # a plain model directory put in its place
        with pytest.raises(ConfigError, match="missing, but the launching process checked this export"):
            load_reward_model(str(foreign_reward), "cpu")
