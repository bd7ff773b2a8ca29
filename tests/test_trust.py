"""The trust boundary without a training run (issue 21 items 2 and 4): the signing key, signed records, the pickle
screen, chat templates in a sandbox, model directories with their own code, export destinations (fast).

The hostile checkpoints of real runs (a pickle payload with recomputed hashes, for export, resume and chat) are in
test_hostile_checkpoint.py."""

from __future__ import annotations

import io
import json
import os
import stat
import time
from pathlib import Path

import pytest
import torch

from dsrecipes.boundary import trust
from dsrecipes.cli import main as cli
from dsrecipes.core.errors import UserError


@pytest.fixture
def key_file(tmp_path, monkeypatch):
    path = tmp_path / "cfg" / "dsrecipes" / "checkpoint.key"
    monkeypatch.setenv(trust.KEY_ENV, str(path))
    return path


class Payload:
    """Unpickling this runs `touch MARKER` (what a hostile checkpoint file would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_the_key_is_made_once_private_and_outside_the_run(key_file, monkeypatch, tmp_path):
    assert not key_file.exists()
    record = trust.sign({"step": 3, "files": {"a": {"size": 1, "hash": "x"}}})
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    first = key_file.read_bytes()
    assert trust.sign({"step": 4})  # used again, never replaced
    assert key_file.read_bytes() == first and trust.signature_problem(record) is None
    monkeypatch.delenv(trust.KEY_ENV)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert trust.key_path() == tmp_path / "xdg" / "dsrecipes" / "checkpoint.key"


def test_unsigned_altered_and_foreign_records_are_named(key_file, tmp_path, monkeypatch):
    record = trust.sign({"step": 3, "world_size": 1, "saved_at": 1.5, "files": {"a.pt": {"size": 10, "hash": "h"}}})
    assert trust.signature_problem(json.loads(json.dumps(record))) is None  # survives its JSON round trip
    unsigned = {k: v for k, v in record.items() if k != trust.SIGNATURE}
    assert "not signed" in trust.signature_problem(unsigned)
    altered = {**record, "files": {"a.pt": {"size": 10, "hash": "recomputed"}}}
    assert "does not match" in trust.signature_problem(altered)
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "other.key"))  # a user without a key yet
    assert "this user has no signing key" in trust.signature_problem(record)
    foreign = trust.sign(unsigned)  # another user's key
    monkeypatch.setenv(trust.KEY_ENV, str(key_file))
    assert "does not match" in trust.signature_problem(foreign)
    with pytest.raises(trust.Untrusted, match="--trust-checkpoint") as refused:
        trust.check(foreign, tmp_path / "ckpt", "checkpoint", "dsrecipes export RUN --out X")
    assert refused.value.exit_code == 2 and "dsrecipes export RUN --out X --trust-checkpoint" in str(refused.value)
    trust.trust([str(tmp_path)])  # the command line trusted the directory above it: accepted, not re-signed
    try:
        assert trust.check(foreign, tmp_path / "ckpt", "checkpoint", "x") is False
        assert trust.signature_problem(foreign) is not None
    finally:
        trust.reset()


def test_a_key_others_can_read_is_refused(key_file):
    trust.sign({"step": 1})
    key_file.chmod(0o644)
    with pytest.raises(UserError, match="mode 0600"):
        trust.sign({"step": 1})


def test_a_key_that_cannot_be_made_is_one_message(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "file" / "checkpoint.key"))  # below a file
    with pytest.raises(UserError, match=f"cannot create the checkpoint signing key .*{trust.KEY_ENV}"):
        trust.ensure_key()


def test_the_train_flag_is_taken_off_the_command_line(tmp_path):
    x, y = tmp_path / "x", tmp_path / "y"
    (x / "step_4").mkdir(parents=True)
    y.mkdir()
    try:
        rest = trust.take_flag(["debug=fast", "--trust-checkpoint", f"{x}/step_4", f"--trust-checkpoint={y}", "-m"])
        assert rest == ["debug=fast", "-m"] and trust.is_trusted(x / "step_4") and trust.is_trusted(y / "z")
        assert not trust.is_trusted(x)
        with pytest.raises(UserError, match="needs the checkpoint"):
            trust.take_flag(["--trust-checkpoint"])
        with pytest.raises(UserError, match="must be an existing path"):
            trust.take_flag([f"--trust-checkpoint={x}/step_5"])
    finally:
        trust.reset()


def test_the_pickle_screen_finds_a_payload_without_running_it(tmp_path):
    from dsrecipes.boundary.safe_load import load, screen
    from dsrecipes.rank.checkpoint import rng_state

    marker = tmp_path / "ran"
    tag = tmp_path / "step_1"
    (tag / "rng").mkdir(parents=True)
    torch.save(rng_state(), tag / "rng" / "rank0.pt")
    assert set(load(tag / "rng" / "rank0.pt")) >= {"python", "numpy", "torch"}  # weights_only with numpy allowed
    screen(tag)
    torch.save({"module": {"w": torch.zeros(2)}, "x": Payload(marker)}, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(UserError, match="its pickle imports posix.system"):
        screen(tag)
    with pytest.raises(UserError, match="refusing to unpickle it"):
        load(tag / "mp_rank_00_model_states.pt")
    # protocol 4 names the callable with STACK_GLOBAL from strings on the stack: not followed, so refused too
    torch.save({"x": Payload(marker)}, tag / "mp_rank_00_model_states.pt", pickle_protocol=4)
    with pytest.raises(UserError, match="not a torch.save file that can be checked"):
        screen(tag)
    assert not marker.exists()


def test_load_maps_a_zip_file_reads_a_legacy_one_and_never_writes_back(tmp_path):
    """safe_load.load memory-maps torch.save's zip files (export reads only the module weights of a file that also
    holds the optimizer states), still reads a legacy pre-zip file someone else wrote, and a tensor changed after
    loading leaves the file as it was (a private mapping)."""
    from dsrecipes.boundary.safe_load import load

    state = {"module": {"w": torch.arange(6, dtype=torch.float32)}, "step": 3}
    mapped, legacy = tmp_path / "zip.pt", tmp_path / "legacy.pt"
    torch.save(state, mapped)
    torch.save(state, legacy, _use_new_zipfile_serialization=False)
    before = mapped.read_bytes()
    got = load(mapped)
    assert got["step"] == 3 and torch.equal(got["module"]["w"], state["module"]["w"])
    assert str(mapped) in Path("/proc/self/maps").read_text()  # mapped, not copied into fresh memory
    got["module"]["w"].mul_(-1)  # in place, on the mapped storage
    assert mapped.read_bytes() == before and torch.equal(load(mapped)["module"]["w"], state["module"]["w"])
    old = load(legacy)
    assert old["step"] == 3 and torch.equal(old["module"]["w"], state["module"]["w"])


# ---------------------------------------------------------------------------------------------------------------
# Chat templates


HOSTILE_TEMPLATES = {
    "python internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "loops for ever": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "huge output": "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}{% endfor %}",
    "huge string": "{{ 'x' * 10000000000 }}",
    "huge filter": "{{ 'x'|center(10000000000) }}",
    "doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "raises": "{{ raise_exception('no') }}",
}


def with_template(model_dir: Path, tmp_path: Path, template: str) -> Path:
    import shutil

    out = tmp_path / "model"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


@pytest.mark.parametrize("name", list(HOSTILE_TEMPLATES))
def test_a_hostile_chat_template_is_one_message_within_seconds(model_dir, tmp_path, capsys, name):
    model = with_template(model_dir, tmp_path, HOSTILE_TEMPLATES[name])
    started = time.monotonic()
    assert cli(["chat", str(model), "--message", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - started < 15  # loading the model included; the template itself has 2 s
    assert err.count("error:") == 1 and "Traceback" not in err and "chat template" in err, err


def test_the_sandbox_renders_what_transformers_renders(model_dir):
    from transformers import AutoTokenizer

    from dsrecipes.boundary.chat_sandbox import render

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "{{ hi }} 中文"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    for generation in (False, True):
        assert render(tok, messages, add_generation_prompt=generation) == tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation)


# ---------------------------------------------------------------------------------------------------------------
# Model directories that need their own code


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_auto_map_directories_are_refused_by_chat_prompt_eval_and_export(model_dir, tmp_path, capsys, where):
    import shutil

    model = tmp_path / "custom"
    shutil.copytree(model_dir, model)
    config = json.loads((model / where).read_text())
    (model / where).write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "modeling_x.X",
                                                                  "AutoTokenizer": ["tok_x.T", None]}}))
    marker = tmp_path / "ran"
    for name in ("modeling_x.py", "tok_x.py"):
        (model / name).write_text(f"open({str(marker)!r}, 'w')\n")
    for argv in (["chat", str(model), "--message", "hi"], ["prompt-eval", "--finetuned", str(model)]):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert f"{model} needs its own Python code to load ({where} auto_map)" in err and "Traceback" not in err
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------------------------
# Export destinations


def test_export_out_to_a_filesystem_root_is_refused_without_listing_it(tmp_path, monkeypatch):
    from dsrecipes.rank import export

    walked = []
    monkeypatch.setattr(export.os, "walk", lambda *a, **k: walked.append(a) or iter(()))
    monkeypatch.setattr(Path, "rglob", lambda *a, **k: walked.append(a) or iter(()))
    for root in (Path("/"), Path("/proc")):
        with pytest.raises(UserError, match="is the root of a filesystem"):
            export.check_out_dir(root, "--out")
    theirs = tmp_path / "theirs"
    (theirs / "deep" / "er").mkdir(parents=True)
    (theirs / "deep" / "er" / "file").write_text("x")
    with pytest.raises(UserError, match="is not a dsrecipes export"):
        export.check_out_dir(theirs, "--out")
    assert walked == []


def test_export_out_slash_on_the_command_line(tmp_path, capsys):
    started = time.monotonic()
    assert cli(["export", str(tmp_path), "--out", "/"]) == 2
    err = capsys.readouterr().err
    assert "--out: / is the root of a filesystem" in err and "Traceback" not in err
    assert time.monotonic() - started < 5


def test_an_export_directory_gets_the_users_umask(tmp_path):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.rank.export import export_initial

    cfg = compose_and_load(["debug=fast"])
    old = os.umask(0o027)
    try:
        out = export_initial(cfg, load_tokenizer(cfg), tmp_path / "export")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750  # not mkdtemp's 0700
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o640
    assert stat.S_IMODE((out / "dsrecipes_export.json").stat().st_mode) == 0o640


def test_an_export_signs_its_files(tmp_path, capsys):
    """An export of this user loads; the same export with a file swapped and its hash recomputed does not."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.manifest import describe
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.rank.export import export_initial

    cfg = compose_and_load(["debug=fast"])
    out = export_initial(cfg, load_tokenizer(cfg), tmp_path / "export")
    marker = json.loads((out / "dsrecipes_export.json").read_text())
    assert marker["signature"].startswith("hmac-sha256:") and "model.safetensors" in marker["hashes"]
    buf = io.BytesIO()
    torch.save({"x": Payload(tmp_path / "ran")}, buf)
    (out / "model.safetensors").unlink()
    (out / "pytorch_model.bin").write_bytes(buf.getvalue())
    marker["hashes"] = describe(out, skip=["dsrecipes_export.json"])
    marker["files"] = sorted(marker["hashes"])
    (out / "dsrecipes_export.json").write_text(json.dumps(marker))  # hashes recomputed; the signature cannot be
    assert cli(["chat", str(out), "--message", "hi"]) == 2
    err = capsys.readouterr().err
    assert "its signature does not match this user's key" in err and f"--trust-checkpoint {out}" in err
    assert cli(["chat", str(out), "--message", "hi", "--trust-checkpoint", str(out)]) == 2
    err = capsys.readouterr().err
    assert "refusing to load its weights: a pickle that holds more than tensors" in err and "Traceback" not in err
    assert not (tmp_path / "ran").exists()


def test_runs_starting_at_once_make_one_key_and_never_read_half_of_it(tmp_path):
    """Eight processes create the key at the same moment: every one gets the same whole key (the key is written
    beside its path and linked into place, so no process ever reads an empty or partial file)."""
    import subprocess
    import sys

    key = tmp_path / "cfg" / "checkpoint.key"
    code = ("import sys; from dsrecipes.boundary import trust; trust.ensure_key(); "
            "sys.stdout.write(trust._load_key(False).decode())")
    env = {**os.environ, trust.KEY_ENV: str(key)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              text=True) for _ in range(8)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert len({out for out, _ in outs}) == 1 and len(outs[0][0]) == 64
    assert sorted(os.listdir(key.parent)) == ["checkpoint.key"]  # no temporary file left behind
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
