"""Hostile cases found by the trust-boundary audit (/tmp/trust/attacks.md lists every attack tried): each is refused
where the thing happens, not by scanning text."""

from __future__ import annotations

import pytest

from dsrecipes.cli import main as cli_main
from dsrecipes.core.errors import ConfigError, UserError


def test_a_run_directory_that_is_shell_text_never_reaches_pdsh(make_cfg, tmp_path, capsys):
    """DeepSpeed's runner with a hostfile hands `--run-dir DIR` to pdsh, which joins the command for each host's
    remote shell without quoting: a recipe's `trainer.output_dir: "out;touch PWNED"` would run there. Validation
    names it, and the builder refuses it whatever validation saw."""
    from dsrecipes.run import launch

    hosts = tmp_path / "hosts"
    hosts.write_text("node0 slots=1\nnode1 slots=1\n")
    ssh = ("launcher=deepspeed", f"launcher.hostfile={hosts}", "launcher.num_nodes=2", "launcher.num_gpus=1")
    cfg = make_cfg(*ssh)
    for evil in ("out;touch PWNED", "out$(touch PWNED)", "out`id`", "out name"):
        with pytest.raises(ConfigError, match="pdsh, whose remote shell"):
            launch.build_plan(cfg, tmp_path / evil, master_port=29511, environ={})
    plan = launch.build_plan(cfg, tmp_path / "run_1", master_port=29511, environ={})
    assert str(tmp_path / "run_1") in plan.commands[0].argv
    forced = make_cfg("launcher=deepspeed", "launcher.extra_args=[--force_multi]")  # pdsh to localhost, no hostfile
    with pytest.raises(ConfigError, match="pdsh, whose remote shell"):
        launch.build_plan(forced, tmp_path / "out;touch PWNED", master_port=29511, environ={})
    assert cli_main(["validate", *ssh, f"trainer.output_dir='{tmp_path}/out;touch PWNED'"]) == 2
    err = capsys.readouterr().err
    assert "trainer.output_dir: launcher=deepspeed with a hostfile or --force_multi hands" in err, err
    assert "Traceback" not in err


def test_score_renders_the_model_template_in_the_sandbox(smollm2_dir, tmp_path):
    """`dsrecipes score` renders the export's chat template, someone else's program: under the sandbox's limits (a
    template that allocates 400 MB is stopped in the child), as chat, prompt-eval and training do; a normal template
    renders what transformers renders."""
    from transformers import AutoTokenizer

    from dsrecipes.boundary.chat_sandbox import TemplateRefused
    from dsrecipes.commands.score import pair_texts, read_pairs

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": '
                     '"a"}], "rejected": [{"role": "assistant", "content": "b"}]}\n')
    (loc, pair), = read_pairs(pairs)
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]
    assert pair_texts(tok, loc, pair)[0] == tok.apply_chat_template(msgs, tokenize=False)
    tok.chat_template = "{% set s = 'x' * 400000000 %}{{ s | length }}"
    with pytest.raises(TemplateRefused, match="MiB of memory"):
        pair_texts(tok, loc, pair)


def _foreign_checkpoint(root, monkeypatch):
    """A colleague's checkpoint (unsigned), trusted on this command line, and this user's key in a private dir."""
    import json

    import dsrecipes.boundary.trust as trust

    key_dir = root / "key"
    key_dir.mkdir(mode=0o700)
    monkeypatch.setenv(trust.KEY_ENV, str(key_dir / "checkpoint.key"))
    tag = root / "colleague" / "checkpoints" / "step_4"
    tag.mkdir(parents=True)
    (tag / "complete.json").write_text(json.dumps({"step": 4, "world_size": 2, "files": {}}))
    trust.trust([str(tag)])
    return tag


@pytest.mark.parametrize("kind", ["link", "directory"])
def test_an_elastic_resume_writes_no_conversion_through_a_foreign_universal(kind, tmp_path, monkeypatch):
    """A trusted foreign checkpoint holding `universal` (a link to one of the user's directories, or its own
    directory): the conversion neither writes through the link nor removes what it did not write."""
    import sys
    import types

    import dsrecipes.boundary.trust as trust
    from dsrecipes.rank.checkpoint import convert_to_universal

    tag = _foreign_checkpoint(tmp_path, monkeypatch)
    victim = tmp_path / "users_own"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    if kind == "link":
        (tag / "universal").symlink_to(victim)
    else:
        (tag / "universal").mkdir()
        (tag / "universal" / "keep.txt").write_text("theirs")

    def fake_conversion(args):  # what ds_to_universal does to its output folder
        out = __import__("pathlib").Path(args.output_folder)
        out.mkdir(exist_ok=True)
        (out / "zero").write_text("converted")

    monkeypatch.setitem(sys.modules, "deepspeed.checkpoint.ds_to_universal",
                        types.SimpleNamespace(main=fake_conversion))
    try:
        with pytest.raises(UserError, match="removes only a conversion of its own"):
            convert_to_universal(tag)
    finally:
        trust.reset()
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in (tag / "universal").iterdir()) == ["keep.txt"]


def test_a_pipeline_file_cannot_set_what_a_shared_recipe_cannot(tmp_path):
    """A pipeline file is shared like a recipe, but its settings reach `train` as command-line overrides, which
    config/safety.py takes as the user's own: a tracking server (it receives MLFLOW_TRACKING_TOKEN), a directory
    written to, or the activate script of a batch job, set there, are refused by the pipeline reader, each with its
    line, nested mappings included."""
    from dsrecipes.config.pipeline_file import load_pipeline

    path = tmp_path / "shared_pipeline.yaml"
    path.write_text("shared:\n  trainer.tracking_uri: http://collector.example:5000\n  data: {cache_dir: /home/u/x}\n"
                    "stages:\n  - name: sft\n    set:\n      trainer: {max_steps: 2, tracking_uri: file:/tmp/x}\n"
                    "      launcher.slurm_venv: /tmp/venv\n      offload.nvme_path: /tmp/nvme\n")
    with pytest.raises(ConfigError) as refused:
        load_pipeline(path)
    problems = refused.value.problems
    assert [p.split(": ", 1)[0] for p in problems] == [f"{path}:{n}" for n in (2, 3, 7, 8, 9)], problems
    assert "a tracking server that receives your credentials" in problems[0] and "batch job" in problems[3]
    ok = tmp_path / "own_pipeline.yaml"
    ok.write_text("stages:\n  - name: sft\n    set: {trainer.max_steps: 2, model.path: /models/x}\n")
    assert [s.key for s in load_pipeline(ok).stages[0].settings] == ["trainer.max_steps", "model.path"]


def test_an_empty_trust_path_trusts_nothing(tmp_path, monkeypatch):
    """`--trust-checkpoint=$CKPT` with CKPT unset resolved to the working directory and trusted every checkpoint
    below it; it is one message now, in train's argv and in export's parser alike."""
    import dsrecipes.boundary.trust as trust

    monkeypatch.chdir(tmp_path)
    try:
        for argv in (["x=1", "--trust-checkpoint="], ["--trust-checkpoint", " "]):
            with pytest.raises(UserError, match="empty PATH"):
                trust.take_flag(argv)
            assert not trust.is_trusted(tmp_path / "run" / "checkpoints" / "step_4")
        assert cli_main(["export", str(tmp_path / "run"), "--trust-checkpoint="]) == 2
        assert not trust.is_trusted(tmp_path / "run")
    finally:
        trust.reset()


def test_a_recipes_regex_reward_that_backtracks_is_stopped_not_a_stalled_rank(monkeypatch):
    """objective.rewards[].pattern comes from a recipe; `re` cannot stop `(a|aa)+$` (exponential on a long run of
    `a`s: a completion could stall the rank for hours, silently). The search is bounded; past it, one ConfigError
    naming the pattern. Ordinary patterns score as re.search does."""
    import dsrecipes.objectives.rewards as rewards
    from dsrecipes.core.schema import RewardConfig

    monkeypatch.setattr(rewards, "PATTERN_SECONDS", 0.05, raising=False)
    check = rewards.check_of(RewardConfig(name="regex", pattern=r"(a|aa)+$"))
    with pytest.raises(ConfigError, match=r"ran past 0.05 s"):
        check("a" * 28 + "b", "")  # re: 0.3 s on the 2-core machine; 2x longer per extra character
    ok = rewards.check_of(RewardConfig(name="regex", pattern=r"\\boxed\{\d+\}"))
    assert (ok(r"so \boxed{42}", ""), ok("42", "")) == (1.0, 0.0)


def test_a_shared_recipes_description_reaches_the_terminal_without_escape_sequences(tmp_path, monkeypatch, capsys):
    """`dsrecipes ls` prints the opening comment of every recipe in $DSRECIPES_RECIPES: a shared file's ESC/BEL
    (an OSC 52 sequence writes the terminal's clipboard, others retitle it or move the cursor) is shown escaped, as
    every console text quoting a file is (errors.visible), and CJK text stays as it is."""
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "hostile.yaml").write_text("# SFT \x1b]52;c;ZWNobyBwd25lZA==\x07 recipe 中文\nmodel: smollm2_135m\n",
                                         encoding="utf-8")
    monkeypatch.setenv("DSRECIPES_RECIPES", str(folder))
    assert cli_main(["ls", "recipe"]) == 0
    out = capsys.readouterr().out
    assert "SFT \\x1b]52;c;ZWNobyBwd25lZA==\\x07 recipe 中文" in out and "\x1b" not in out and "\x07" not in out, out


@pytest.mark.parametrize("files,val", [(["../../secret.jsonl"], None), (["/etc/passwd"], None),
                                       (["part_00.jsonl"], "../val.jsonl")])
def test_a_shard_manifest_names_only_its_own_parts(files, val, tmp_path):
    """data.shard_dir may be a colleague's: its manifest.json lists the part names, which were joined to the
    directory and read (scanned before any hash check) wherever they led. Only the names `dsrecipes shard` writes
    are accepted; anything else is one DataError, nothing read."""
    import json

    from dsrecipes.core.errors import DataError
    from dsrecipes.data.shard.manifest import read_manifest

    shard = tmp_path / "colleague_shard"
    shard.mkdir()
    (shard / "manifest.json").write_text(json.dumps({"version": 1, "parts": 1, "balance": "rows", "files": files,
                                                     "counts": [1], "sha256": ["0" * 64], "val_file": val}))
    with pytest.raises(DataError, match="lists files other than the parts"):
        read_manifest(str(shard))
    (shard / "manifest.json").write_text(json.dumps({"version": 1, "parts": 1, "balance": "rows",
                                                     "files": ["part_00.jsonl"], "counts": [1], "sha256": ["0" * 64]}))
    assert read_manifest(str(shard)).part_path(0) == str(shard / "part_00.jsonl")


def test_a_model_directory_linking_outside_itself_is_refused(tmp_path, make_cfg):
    """A model directory from a git clone or a tarball may carry `chat_template.jinja -> /root/.aws/credentials`:
    transformers reads the link as the model's template, which then renders the file into every prompt (and the
    model trains on it). Refused where the tokenizer is loaded and by every command's model-directory check; a hub
    cache snapshot (links into its repository's blobs) still loads (tests/test_hub.py)."""
    import shutil

    from dsrecipes.core.paths import TINY_TOKENIZER_DIR
    from dsrecipes.core.tokenizer import custom_code_problems, load_tokenizer

    secret = tmp_path / "credentials"
    secret.write_text("[default]\naws_secret_access_key = hunter2\n")
    model = tmp_path / "cloned_model"
    shutil.copytree(TINY_TOKENIZER_DIR, model)
    cfg = make_cfg(f"model.tokenizer_path={model}", check_files=False)
    assert load_tokenizer(cfg) is not None and custom_code_problems("model.path", model) == []
    (model / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(ConfigError, match="chat_template.jinja is a link leading outside"):
        load_tokenizer(cfg)
    assert "is a link leading outside" in custom_code_problems("model.path", model)[0]


def test_no_module_renders_a_model_template_outside_the_sandbox():
    """`tokenizer.apply_chat_template` renders a model directory's template in this process, without the sandbox's
    limits (`dsrecipes score` did): no module of the package calls it."""
    import ast
    from pathlib import Path

    import dsrecipes

    calls = []
    for path in sorted(Path(dsrecipes.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "apply_chat_template":
                calls.append(f"{path.name}:{node.lineno}")
    assert calls == [], calls


def test_an_atomic_write_never_writes_through_a_link_planted_beside_its_target(tmp_path):
    """Every result file is written beside its target, then renamed. The name beside it was `.NAME.PID.tmp`, opened
    with O_TRUNC following links: in a shared directory (`score --out /tmp/r.jsonl`) anyone could plant that name as
    a link to a file of yours, which the write then replaced. The name is not guessable now and opened O_EXCL |
    O_NOFOLLOW; a link already at the target itself is replaced, never followed."""
    import os

    from dsrecipes.core.fileio import atomic_write_text

    victim = tmp_path / "victim.txt"
    victim.write_text("yours")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / f".r.jsonl.{os.getpid()}.tmp").symlink_to(victim)
    (shared / "s.jsonl").symlink_to(victim)
    atomic_write_text(shared / "r.jsonl", "result\n")
    atomic_write_text(shared / "s.jsonl", "result\n")
    assert victim.read_text() == "yours"
    assert (shared / "r.jsonl").read_text() == "result\n" and not (shared / "s.jsonl").is_symlink()


def test_an_elastic_resume_converts_a_foreign_checkpoint_into_the_run_not_into_it(tmp_path, monkeypatch):
    """A colleague's checkpoint (trusted on the command line) resumed at another world size: the universal conversion
    is written into this run's directory (`<run>/universal/step_4`, signed by this user) and loaded from there; the
    colleague's directory gains nothing. (Our own checkpoints keep `<tag>/universal`: test_train_runs.)"""
    import hashlib
    import sys
    import types

    import torch.distributed

    import dsrecipes.boundary.trust as trust
    from dsrecipes.core.runplan import ResumePlan
    from dsrecipes.rank.checkpoint import open_resume

    tag = _foreign_checkpoint(tmp_path, monkeypatch)
    run = tmp_path / "my_run"
    run.mkdir()

    def fake_conversion(args):
        out = __import__("pathlib").Path(args.output_folder)
        out.mkdir()
        (out / "zero").write_text("converted")

    monkeypatch.setitem(sys.modules, "deepspeed.checkpoint.ds_to_universal",
                        types.SimpleNamespace(main=fake_conversion))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: None)
    before = sorted(p.name for p in tag.iterdir())
    digest = hashlib.sha256((tag / "complete.json").read_bytes()).hexdigest()
    try:
        point = open_resume(ResumePlan(str(tag), 4, 2, True, digest), run)
    finally:
        trust.reset()
    assert (point.load_dir, point.tag, point.universal) == (run / "universal", "step_4", True)
    assert (run / "universal" / "step_4" / "zero").read_text() == "converted"
    assert sorted(p.name for p in tag.iterdir()) == before
    point.checked.close()


def test_a_hostfile_line_past_the_part_checked_never_reaches_ssh(tmp_path):
    """hostfile_problems read the first MiB only, while DeepSpeed's runner (and mpirun) read the whole file: a
    line `-oProxyCommand=...` after a MiB of comments was never checked. A longer file is refused now."""
    from dsrecipes.boundary.launcher_args import hostfile_problems

    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=1\n" + "#" * (1 << 20) + "\n-oProxyCommand=touch${IFS}x slots=1\n")
    assert "is longer than" in " ".join(hostfile_problems(str(hosts)))
    hosts.write_text("node1 slots=1\nnode2#;-oProxyCommand=x slots=1\n")  # DeepSpeed's host: 'node2#;-oProxy...'
    assert [p.split(": ")[1] for p in hostfile_problems(str(hosts))] == [f"{hosts}:2"]
    hosts.write_text("node1 slots=1\n# a comment\nnode2 slots=1  # trailing\n")
    assert hostfile_problems(str(hosts)) == []


def test_an_error_quoting_a_shared_recipe_shows_its_control_characters_escaped(tmp_path, capsys):
    """A message quoting someone else's file (here a recipe's unknown key) reached the terminal with its ESC/BEL
    raw: a terminal sequence (title, clipboard). UserError.render escapes them."""
    recipe = tmp_path / "shared.yaml"
    recipe.write_text('model: smollm2_135m\n"bad\\e]0;PWN\\akey": 1\n', encoding="utf-8")  # YAML's \e, \a
    assert cli_main(["validate", f"recipe={recipe}"]) == 2
    err = capsys.readouterr().err
    assert "bad\\x1b]0;PWN\\x07key: unknown key" in err and "\x1b" not in err and "\x07" not in err, err
