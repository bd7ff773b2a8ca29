"""Hostile shared recipes, third round: a shared recipe's registry whose entries name a bucket, and a reward model
directory that is a damaged or foreign export (config/safety.py, objectives/rewards.py)."""

from __future__ import annotations

import json

import pytest

from dsrecipes.cli import main as cli_main
from dsrecipes.core.errors import ConfigError
from tests.test_redteam_live2 import signed_reward  # noqa: F401 (a fixture)
from tests.test_redteam_trust2 import URL, counted_store  # noqa: F401 (a fixture)


def _registry(tmp_path, kind="json"):
    """A registry file beside a shared recipe, its one entry `theirs` an object in s3://their-bucket."""
    if kind == "json":
        registry = tmp_path / "dataset_info.json"
        registry.write_text(json.dumps({"theirs": {"file_name": URL}}), encoding="utf-8")
    else:
        registry = tmp_path / "registry.yaml"
        registry.write_text(f"theirs:\n  paths: [{URL}]\n  format: alpaca\n", encoding="utf-8")
    return registry


def test_a_shared_recipes_registry_never_hands_its_bucket_the_users_credentials(counted_store, tmp_path,  # noqa: F811
                                                                              monkeypatch, capsys):
    # Was: a shared recipe's dataset.registry (a local dataset_info.json beside it) whose entry's file_name is
    # s3://their-bucket/... was read with the user's AWS credentials once dataset.use named the entry: validate sent
    # requests signed with the user's access key id to the recipe author's bucket, then said OK.
    from tests.test_messages_hostile import refused

    monkeypatch.chdir(tmp_path)
    for kind in ("json", "yaml"):
        registry = _registry(tmp_path, kind)
        recipe = tmp_path / "shared.yaml"
        recipe.write_text(f"dataset:\n  use: [theirs]\n  registry: {registry}\n", encoding="utf-8")
        refused(capsys, ["validate", f"recipe={recipe}"], f"set by {recipe}:3, a shared recipe",
                "theirs", "s3://their-bucket/", "DSRECIPES_S3_BUCKETS=their-bucket",
                "dataset.registry=... on the command line")
        # the entry named on the command line, the registry by the recipe: the same
        recipe.write_text(f"dataset:\n  registry: {registry}\n", encoding="utf-8")
        refused(capsys, ["validate", f"recipe={recipe}", "dataset.use=[theirs]"], f"set by {recipe}:2")
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(f"stages:\n  - name: a\n    set:\n      dataset.registry: {registry}\n"
                        "      dataset.use: [theirs]\n", encoding="utf-8")
    refused(capsys, ["pipeline", str(pipeline)], f"{pipeline}: stage 'a' (line 2): dataset.registry", "theirs",
            "DSRECIPES_S3_BUCKETS=their-bucket")
    assert counted_store == [] and not (tmp_path / "runs").exists()


def test_a_registry_the_user_named_or_allowed_is_read_as_before(counted_store, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    registry = _registry(tmp_path)
    assert cli_main(["validate", f"dataset.registry={registry}", "dataset.use=[theirs]"]) == 0
    assert counted_store and all("Credential=dsrecipes-test-key/" in a for a in counted_store)
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(f"dataset:\n  use: [theirs]\n  registry: {registry}\n", encoding="utf-8")
    monkeypatch.setenv("DSRECIPES_S3_BUCKETS", "their-bucket")
    assert cli_main(["validate", f"recipe={recipe}"]) == 0


def test_a_reward_model_export_is_checked_as_chat_checks_it_before_launch(signed_reward, tmp_path, monkeypatch,  # noqa: F811
                                                                         capsys):
    # Was: objective.reward_model (objectives/rewards.reward_model_problems at validate, load_reward_model on the
    # ranks) checked only for config.json, safetensors and no own code: an objective=reward export signed with
    # another user's key, or with a file changed after it was written, passed validate (exit 0) and loaded on the
    # ranks, where chat / prompt-eval / score refuse both (serve/inference.check_loadable).
    from dsrecipes.boundary import trust
    from dsrecipes.objectives.rewards import load_reward_model, reward_model_problems
    from tests.test_grpo import GRPO
    from tests.test_messages_hostile import refused

    monkeypatch.chdir(tmp_path)
    model, _ = signed_reward
    argv = ["validate", *GRPO, f"objective.reward_model={model}"]
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "another_users_key"))
    trust.ensure_key()
    refused(capsys, argv, f"objective.reward_model: {model}: refusing to load this export",
            f"dsrecipes validate ... --trust-checkpoint {model}")  # the command that refused it
    trust.trust([str(model)])  # train's --trust-checkpoint (cli.py takes it off train's arguments)
    try:
        assert reward_model_problems(str(model)) == []
        pins = trust.accepted_exports()  # plan.json's exports
    finally:
        trust.reset()
    with trust.launched(pins):  # a rank: accepted as its launching process accepted it (test_redteam_trust4)
        assert load_reward_model(str(model), "cpu")
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "key"))
    assert cli_main(argv) == 0
    capsys.readouterr()  # transformers' progress bar of the load above
    (model / "config.json").write_text((model / "config.json").read_text() + " ", encoding="utf-8")
    refused(capsys, argv, f"objective.reward_model: {model}: damaged export", "config.json")
    with pytest.raises(ConfigError, match=r"objective.reward_model: .*damaged export"):
        load_reward_model(str(model), "cpu")  # and a rank checks its files again before loading them
