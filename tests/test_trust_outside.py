"""Nothing a recipe sets reaches outside the run directory or the machine (issue 50 item 2), tried as a hostile recipe
author would: a shared recipe (a file by path, a $DSRECIPES_RECIPES folder's) naming a tracking server that would
receive the user's MLFLOW_TRACKING_TOKEN, a cache or NVMe directory elsewhere, a hostfile (a token file), a
rendezvous host, a run directory outside the working one. Each is refused on the composition, by key and file,
before anything connects (a local HTTP server records that no request arrived); the same values from the command
line or the config tree are accepted. config/field_classes.py classifies every text field of the schema."""

from __future__ import annotations

import dataclasses
import http.server
import threading
from typing import List, Optional

import pytest
import yaml

from dsrecipes.boundary.launcher_args import extra_args_problems, hostfile_problems
from dsrecipes.cli import main as cli_main
from dsrecipes.config.field_classes import FIELDS, FieldClass, text_fields
from dsrecipes.core.schema import LauncherKind

TOKEN = "dsr-mlflow-token-5be1"


def test_every_text_field_of_the_schema_is_classified():
    found = set(text_fields())
    assert found - set(FIELDS) == set(), "classify these in config/field_classes.py"
    assert set(FIELDS) - found == set(), "fields no longer in the schema"
    assert {k for k, v in FIELDS.items() if v is FieldClass.user_named} >= {
        "trainer.tracking_uri", "data.cache_dir", "launcher.hostfile", "offload.nvme_path"}


def test_a_new_text_field_fails_until_classified():
    @dataclasses.dataclass
    class Extra:
        upload_url: Optional[str] = None
        hosts: List[str] = dataclasses.field(default_factory=list)
        steps: int = 1

    assert set(text_fields(Extra, "trainer.")) - set(FIELDS) == {"trainer.upload_url", "trainer.hosts"}


HOSTILE = {  # field -> a shared recipe's value
    "trainer.tracking_uri": "http://127.0.0.1:9/api",
    "data.cache_dir": "/tmp/dsr-elsewhere-cache",
    "offload.nvme_path": "/tmp/dsr-elsewhere-nvme",
    "launcher.hostfile": "/etc/hostname",
    "launcher.master_addr": "attacker.example.com",
    "launcher.rdzv_endpoint": "attacker.example.com:29400",
    "trainer.output_dir": "/tmp/dsr-elsewhere-run",
}


def _recipe(folder, name, values, flat=True):
    data = {}
    for key, value in values.items():
        if flat:
            data[key] = value
        else:
            group, _, leaf = key.partition(".")
            data.setdefault(group, {})[leaf] = value
    text = ("" if flat else "# @package _global_\n") + yaml.safe_dump(data)
    path = folder / f"{name}.yaml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("where", ["file by path", "recipe folder"])
@pytest.mark.parametrize("key", sorted(HOSTILE))
def test_a_shared_recipe_cannot_name_a_place_outside(key, where, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "shared"
    folder.mkdir()
    path = _recipe(folder, "hostile", {key: HOSTILE[key]}, flat=where == "file by path")
    monkeypatch.setenv("DSRECIPES_RECIPES", str(folder))
    recipe = f"recipe={path}" if where == "file by path" else "recipe=hostile"
    assert cli_main(["validate", recipe]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"{key}: set by {path}" in err and "shared recipe" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("key", ["trainer.tracking_uri", "data.cache_dir", "launcher.master_addr",
                                 "trainer.output_dir"])
def test_the_same_value_from_the_command_line_is_the_users(key, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "shared"
    folder.mkdir()
    path = _recipe(folder, "hostile", {key: HOSTILE[key]})
    assert cli_main(["validate", f"recipe={path}", f"{key}={HOSTILE[key]}"]) == 0, capsys.readouterr().err
    assert cli_main(["validate", f"{key}={HOSTILE[key]}"]) == 0, capsys.readouterr().err


def test_the_config_tree_and_relative_run_directories_are_accepted(tmp_path, capsys):
    assert cli_main(["validate", "zero=stage3", "offload=nvme"]) == 0, capsys.readouterr().err  # conf/: /local_nvme
    ok = _recipe(tmp_path, "ok", {"trainer.output_dir": "runs/sft"})
    assert cli_main(["validate", f"recipe={ok}"]) == 0, capsys.readouterr().err
    for bad in ("../outside", "~/run", "runs/../../up"):
        path = _recipe(tmp_path, "bad", {"trainer.output_dir": bad})
        assert cli_main(["validate", f"recipe={path}"]) == 2
        assert "trainer.output_dir: set by" in capsys.readouterr().err, bad


class _Recorder(http.server.BaseHTTPRequestHandler):
    requests: List[str] = []

    def _any(self) -> None:
        _Recorder.requests.append(f"{self.command} {self.path} {self.headers.get('Authorization')}")
        self.send_response(500)
        self.end_headers()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    _Recorder.requests = []
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", _Recorder.requests
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_recipes_tracking_server_receives_nothing(server, command, tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    url, requests = server
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)
    monkeypatch.chdir(tmp_path)
    path = _recipe(tmp_path, "steal", {"trainer.report_to": ["mlflow"], "trainer.tracking_uri": url,
                                        "trainer.experiment": "x"})
    argv = [f"recipe={path}", "trainer.max_steps=1", "scheduler.warmup_steps=0", f"trainer.output_dir={tmp_path / 'run'}"]
    assert cli_main(["validate", *argv] if command == "validate" else argv) == 2
    out, err = capsys.readouterr()
    assert "trainer.tracking_uri: set by" in err and TOKEN not in out + err, err
    assert requests == [], "the recipe's host was contacted"
    assert not (tmp_path / "run").exists()
    import urllib.request  # (the recorder works: a request it is sent is seen)

    with pytest.raises(Exception):
        urllib.request.urlopen(url + "/probe", timeout=5)
    assert requests and requests[0].startswith("GET /probe")


def test_a_recipes_file_store_is_refused_and_the_users_accepted(tmp_path, capsys):
    store = tmp_path / "elsewhere" / "mlruns"
    path = _recipe(tmp_path, "store", {"trainer.tracking_uri": f"file:{store}"})
    assert cli_main(["validate", f"recipe={path}"]) == 2
    assert "trainer.tracking_uri: set by" in capsys.readouterr().err
    assert cli_main(["validate", f"trainer.tracking_uri=file:{store}"]) == 0
    assert not store.exists()


def test_a_hostfile_error_never_quotes_the_file(tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text("ghp_SECRETTOKENVALUE1234 slots=x\n")
    problems = hostfile_problems(str(token))
    assert problems and all("ghp_SECRET" not in p for p in problems), problems
    assert f"{token}:1:" in problems[0]
    assert cli_main(["validate", "launcher=deepspeed", f"launcher.hostfile={token}", "launcher.num_nodes=2",
                     "launcher.num_gpus=2"]) == 2
    err = capsys.readouterr().err
    assert "launcher.hostfile" in err and "ghp_SECRET" not in err, err
    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfesecret")
    assert all("secret" not in p for p in hostfile_problems(str(binary)))


@pytest.mark.parametrize("value", ["\u0661\u0662", "\uff12", "2\u0663"])  # Arabic-Indic, fullwidth, mixed digits
def test_launcher_options_take_ascii_digits_only(value):
    assert extra_args_problems(LauncherKind.torchrun, [f"--max-restarts={value}"])
    assert extra_args_problems(LauncherKind.deepspeed, [f"--ssh_port={value}"])
    assert not extra_args_problems(LauncherKind.torchrun, ["--max-restarts=2"])


def test_a_sweep_refuses_before_its_first_job(tmp_path, monkeypatch, capsys):
    """Every job of a sweep is checked before the first starts: one job's recipe naming a cache elsewhere stops it."""
    folder = tmp_path / "shared"
    folder.mkdir()
    _recipe(folder, "clean", {"trainer.max_steps": 1})
    _recipe(folder, "hostile", {"data.cache_dir": str(tmp_path / "elsewhere")})
    monkeypatch.setenv("DSRECIPES_RECIPES", str(folder))
    monkeypatch.chdir(tmp_path)
    assert cli_main(["-m", "recipe=clean,hostile", "launcher.dry_run=true"]) == 2
    err = capsys.readouterr().err
    assert f"data.cache_dir: set by {folder / 'hostile.yaml'}" in err and "Traceback" not in err, err
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "elsewhere").exists()


def test_an_override_interpolating_the_environment_is_refused_not_leaked(tmp_path, monkeypatch, capsys):
    """Hydra records the overrides' text (hydra.overrides.task): it is read as text, never resolved, so the run
    refuses `${oc.env:SECRET}` where the value is used - one message, no traceback."""
    monkeypatch.setenv("DSR_OUTSIDE_SECRET", TOKEN)
    monkeypatch.chdir(tmp_path)
    assert cli_main(["trainer.experiment=${oc.env:DSR_OUTSIDE_SECRET}", "trainer.max_steps=1",
                     f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: trainer.experiment: reads the environment variable") and TOKEN not in err, err
    assert not (tmp_path / "run").exists()
