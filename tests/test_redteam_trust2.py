"""Hostile shared recipes, second round: what a recipe someone else wrote can make this machine do with the user's
addresses, credentials and code (config/safety.py, data/sources/remote.py)."""

from __future__ import annotations

import pytest

from dsrecipes.cli import main as cli_main


@pytest.mark.parametrize("launcher,key,args", [
    ("torchrun", "extra_args", ["${oc.select:nope,'--local_addr=10.6.6.6'}"]),
    ("torchrun", "extra_args", ["--local${oc.select:nope,_}addr=10.6.6.6"]),
    ("slurm", "slurm_sbatch_args", ["--mail-type=ALL", "--mail-${oc.select:nope,user}=x@evil.example"]),
])
def test_a_shared_recipes_outside_option_is_judged_as_it_resolves(launcher, key, args, tmp_path, monkeypatch, capsys):
    # Was: config/safety judged launcher.extra_args / slurm_sbatch_args elements on their text, so an element that
    # resolves to --local_addr=HOST / --mail-user=ADDR (an oc.select default, a string interpolation) passed validate.
    import json

    from tests.test_messages_hostile import refused

    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(f"launcher:\n  {key}: {json.dumps(args)}\n", encoding="utf-8")
    option = "--mail-user" if launcher == "slurm" else "--local_addr"
    refused(capsys, ["validate", f"launcher={launcher}", f"recipe={recipe}"],
            f"launcher.{key}[{len(args) - 1}]: {option} set by {recipe}:2, a shared recipe")


def test_a_shared_recipes_option_from_another_key_is_refused(tmp_path, monkeypatch, capsys):
    # The option's text in a field that is not a path (trainer.experiment), the list naming it by interpolation.
    from tests.test_messages_hostile import refused

    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "shared.yaml"
    recipe.write_text("trainer:\n  experiment: --local_addr=10.6.6.6\nlauncher:\n  extra_args: ['${trainer.experiment}']\n",
                      encoding="utf-8")
    refused(capsys, ["validate", "launcher=torchrun", f"recipe={recipe}"],
            f"launcher.extra_args[0]: --local_addr set by {recipe}:4, a shared recipe")
    assert cli_main(["validate", "launcher=torchrun", "trainer.experiment='--local_addr=10.0.0.1'",
                     "launcher.extra_args=['${trainer.experiment}']"]) == 0


@pytest.mark.timeout(60)  # on a regression the torchrun stage waits for 10.6.6.6
@pytest.mark.parametrize("launcher,key,setting,option", [
    ("torchrun", "extra_args", "--local_addr=10.6.6.6", "--local_addr"),
    ("slurm", "slurm_sbatch_args", "--mail-user=x@evil.example", "--mail-user"),
])
def test_a_pipeline_files_outside_option_by_interpolation_is_refused(launcher, key, setting, option, tmp_path,
                                                                   monkeypatch, capsys):
    # Was: config/pipeline_file judged launcher.extra_args on its text, and `${trainer.experiment}` is a value it
    # allows; its settings reach train as command-line overrides (the user's own to config/safety), so the stage ran
    # `torch.distributed.run ... --local_addr=10.6.6.6` (tried: launch.txt of the stage).
    from tests.test_messages_hostile import refused

    monkeypatch.chdir(tmp_path)  # on a regression the pipeline runs: into runs/ here, never the checkout's
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(f"stages:\n  - name: a\n    set:\n      launcher: {launcher}\n      trainer.experiment: {setting}\n"
                        f"      launcher.{key}:\n        - ${{trainer.experiment}}\n", encoding="utf-8")
    refused(capsys, ["pipeline", str(pipeline)], f"{pipeline}: stage 'a' (line 2): launcher.{key}[0]: {option} set by {pipeline}:6, a pipeline file")
    assert not (tmp_path / "runs").exists()


@pytest.fixture
def counted_store(s3_server, monkeypatch):
    """s3://their-bucket/d/train.jsonl behind a proxy that records each request's Authorization header."""
    from dsrecipes.data.sources import remote
    from tests.helpers.s3server import FaultProxy
    from tests.test_store import lines

    fs = remote.s3()
    if not fs.exists("s3://their-bucket"):
        fs.mkdir("s3://their-bucket")
    fs.pipe("s3://their-bucket/d/train.jsonl", ("\n".join(lines(30)) + "\n").encode())
    seen = []

    class Recording(FaultProxy):
        def _fault(self, handler):
            seen.append(handler.headers.get("Authorization", ""))
            return super()._fault(handler)

    proxy = Recording(s3_server.port).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.delenv("DSRECIPES_S3_BUCKETS", raising=False)
    yield seen
    proxy.stop()


URL = "s3://their-bucket/d/train.jsonl"


def test_a_shared_recipes_bucket_never_sees_the_users_credentials(counted_store, tmp_path, monkeypatch, capsys):
    # Was: a shared recipe's dataset.paths: [s3://their-bucket/...] was read with the user's AWS credentials:
    # validate sent 4 HEADs signed 'AWS4-HMAC-SHA256 Credential=<the user's access key id>/...' to a bucket the
    # recipe's author chose (its server access logs name the key), then said OK.
    from tests.test_messages_hostile import refused

    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(f"dataset:\n  paths: [{URL}]\n", encoding="utf-8")
    refused(capsys, ["validate", f"recipe={recipe}"], f"dataset.paths: s3://their-bucket/... set by {recipe}:2, a "
            "shared recipe", "DSRECIPES_S3_BUCKETS=their-bucket")
    sources = tmp_path / "sources.yaml"
    sources.write_text(f"dataset:\n  sources:\n    - {{name: a, paths: ['${{oc.select:x,{URL}}}']}}\n", encoding="utf-8")
    refused(capsys, ["validate", f"recipe={sources}"], "dataset.sources: s3://their-bucket/... set by")
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(f"stages:\n  - name: a\n    set:\n      dataset.paths: [{URL}]\n", encoding="utf-8")
    refused(capsys, ["pipeline", str(pipeline)], f"{pipeline}: stage 'a' (line 2): dataset.paths: s3://their-bucket")
    assert counted_store == [] and not (tmp_path / "runs").exists()


def test_a_bucket_the_user_named_or_allowed_is_read_with_their_credentials(counted_store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["validate", f"dataset.paths=[{URL}]"]) == 0
    assert counted_store and all("Credential=dsrecipes-test-key/" in a for a in counted_store)
    recipe = tmp_path / "shared.yaml"
    recipe.write_text(f"dataset:\n  paths: [{URL}]\n", encoding="utf-8")
    monkeypatch.setenv("DSRECIPES_S3_BUCKETS", "other,their-bucket")
    assert cli_main(["validate", f"recipe={recipe}"]) == 0
