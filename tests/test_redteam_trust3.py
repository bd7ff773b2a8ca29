"""Hostile shared recipes, third round: a shared recipe's registry whose entries name a bucket, and a reward model
directory that is a damaged or foreign export (config/safety.py, objectives/rewards.py)."""

from __future__ import annotations

import json

from dsrecipes.cli import main as cli_main
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
