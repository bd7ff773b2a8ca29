"""Trusting a checkpoint or export, fourth round: the commands around a run must carry the one decision the user made
on train's command line (`--trust-checkpoint PATH`) exactly where they load what it covers, and the ranks, which
have no command line, must check a reward model export where they load it (boundary/trust.py)."""

from __future__ import annotations

import pytest

from dsrecipes.boundary import trust
from dsrecipes.cli import main as cli_main
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
    refused(capsys, argv, "refusing to load this export", f"--trust-checkpoint {foreign_reward}")
    assert cli_main([*argv, "--trust-checkpoint", str(foreign_reward)]) == 0
    assert cli_main([*argv, f"--trust-checkpoint={foreign_reward}"]) == 0
    refused(capsys, argv, "refusing to load this export")  # one command's decision, never carried over
    refused(capsys, [*argv, "--trust-checkpoint="], "--trust-checkpoint")  # an empty PATH trusts nothing
