"""Schema-driven: every string field of the config (enumerated from the dataclasses, never listed by hand), given
shell metacharacters, option-looking strings, absolute paths and `..` segments, either is refused by name or never
reaches a launcher's command line, a rank's environment or a support file (batch script, .deepspeed_env, hostfile)
except as one whole argument after dsrecipes' own path options (`--run-dir`, `--hostfile`, `--rdzv_id`), which no
shell reads. Every other field reaches the ranks only inside `config.yaml` in the run directory."""

from __future__ import annotations

import copy
import dataclasses
import shlex
import typing
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import pytest

from dsrecipes.core.schema import LauncherKind, SourceConfig, TrainConfig

MARK = "HOSTILE"
VALUES = [
    f"{MARK}; touch /tmp/{MARK}", f"$({MARK})", f"`{MARK}`", f"{MARK}\nexport LD_PRELOAD=/x.so", f"--{MARK}",
    f"-{MARK}=1", f"/tmp/{MARK}", f"../../{MARK}", f"{MARK}' \"x",
]
PATH_OPTIONS = ("--run-dir", "--hostfile", "--rdzv_id")  # dsrecipes' own options whose value is one path or id
Path_ = Tuple[Any, ...]


def string_fields(cls: Any = TrainConfig, prefix: Path_ = ()) -> Iterator[Tuple[Path_, str]]:
    """(attribute path, 'str' | 'list' | 'dict') for every string, list-of-string and string-valued mapping field,
    nested dataclasses and lists of dataclasses (one element) included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if typing.get_origin(tp) is typing.Union and len(args) == 1:
            tp = args[0]
        origin, inner = typing.get_origin(tp), typing.get_args(tp)
        path = prefix + (f.name,)
        if tp is str:
            yield path, "str"
        elif dataclasses.is_dataclass(tp):
            yield from string_fields(tp, path)
        elif origin is list and inner[0] is str:
            yield path, "list"
        elif origin is list and dataclasses.is_dataclass(inner[0]):
            yield from string_fields(inner[0], path + (0,))
        elif origin is dict and inner[0] is str:
            yield path, "dict"


def dotted(path: Path_) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else p for p in path).replace(".[", "[")


def with_value(cfg: TrainConfig, path: Path_, kind: str, value: str) -> TrainConfig:
    cfg = copy.deepcopy(cfg)
    node: Any = cfg
    for step in path[:-1]:
        if isinstance(step, int):  # a list of dataclasses (dataset.sources): one element to hold the value
            node.append(SourceConfig(name="s", paths=["/data/s.jsonl"]))
            node = node[step]
        else:
            parent, node = node, getattr(node, step)
            if node is None:  # an optional group left unset (dataset.sources[].share): give it its defaults
                hint = typing.get_type_hints(type(parent))[step]
                node = next(a for a in typing.get_args(hint) if dataclasses.is_dataclass(a))()
                setattr(parent, step, node)
    new = {"str": value, "list": ["ok", value], "dict": {value: value, "OMP_NUM_THREADS": value}}[kind]
    setattr(node, path[-1], new)
    return cfg


def for_kind(cfg: TrainConfig, kind: LauncherKind) -> TrainConfig:
    ln = dataclasses.replace(cfg.launcher, kind=kind, num_gpus=1 if kind is LauncherKind.local else 2)
    return dataclasses.replace(cfg, launcher=ln)


def typed(key: str, value: str) -> bool:
    """Fields whose value may reach a batch script as itself because it has a checked shape (and is quoted)."""
    from dsrecipes.boundary.values import path_problem

    return key == "launcher.slurm_venv" and path_problem(value) is None and shlex.quote(value) == value


def leaks(plan, run_dir: Path, allowed: str = "\0") -> List[str]:
    """Where MARK reached a command line, an environment or a file other than as one argument after PATH_OPTIONS
    (or inside the run directory's path where that path has the checked shape of boundary.values.ABS_PATH)."""
    from dsrecipes.boundary.values import path_problem

    checked = path_problem(str(run_dir)) is None

    def seen(text: str) -> bool:
        text = text.replace(allowed, "<TYPED>")
        return MARK in (text.replace(str(run_dir), "<RUN>").replace(run_dir.name, "<NAME>") if checked else text)

    found = []
    for cmd in plan.commands:
        for i, arg in enumerate(cmd.argv):
            if seen(arg) and (i == 0 or cmd.argv[i - 1] not in PATH_OPTIONS):
                found.append(f"argv {arg!r} after {cmd.argv[i - 1]!r}")
        found += [f"env {k}={v!r}" for k, v in cmd.env.items() if MARK in k or MARK in v]
        words = shlex.split(cmd.shell())  # launch.txt: the line reads back as exactly this command
        assert words == [f"{k}={v}" for k, v in sorted(cmd.env.items())] + cmd.argv
    found += [f"file {name}" for name, text in plan.files.items() if seen(text)]
    return found


def test_no_string_field_reaches_a_command_line_an_environment_or_a_script_unchecked(tmp_path, monkeypatch):
    from dsrecipes.config.validate import validate
    from dsrecipes.core.errors import ConfigError
    from dsrecipes.run import launch

    monkeypatch.chdir(tmp_path)
    fields = list(string_fields())
    assert len(fields) > 30 and (("launcher", "extra_args"), "list") in fields and (("launcher", "env"), "dict") in fields
    base = TrainConfig()
    assert all(validate(for_kind(base, k), check_files=False) == [] for k in LauncherKind)  # only the value can fail
    refused, passed = set(), set()
    for path, kind in fields:
        for value in VALUES:
            cfg = with_value(base, path, kind, value)
            for launcher_kind in LauncherKind:
                cfg_k = for_kind(cfg, launcher_kind)
                key = dotted(path)
                problems = validate(cfg_k, check_files=False)
                if problems:  # refused: the message names the field (or shows the value)
                    assert any(key.split("[")[0] in p or MARK in p for p in problems), problems
                    refused.add(key)
                    continue
                run_dir = Path(cfg_k.trainer.output_dir).resolve() if cfg_k.trainer.output_dir else tmp_path / "run"
                try:
                    plan = launch.build_plan(cfg_k, run_dir, master_port=29511, environ={})
                except ConfigError as exc:  # the builders check again: it must name the key
                    assert key.split("[")[0] in str(exc) or "trainer.output_dir" in str(exc), str(exc)
                    refused.add(key)
                    continue
                allowed = value if typed(key, value) else "\0"
                assert not leaks(plan, run_dir, allowed), (key, value, launcher_kind.value, leaks(plan, run_dir))
                passed.add(key)
    # the launcher's own string fields are all checked; the rest are data the ranks read from config.yaml
    launcher_fields = {dotted(p) for p, _ in fields if p[0] == "launcher"}
    assert launcher_fields - {"launcher.hostfile"} <= refused, launcher_fields - refused
    assert "trainer.output_dir" in refused  # launcher=slurm writes it into the batch script: its shape is checked
    assert passed  # e.g. dataset.paths, template.separator: never on a command line


@pytest.mark.parametrize("value", VALUES)
def test_a_hostile_run_directory_never_reaches_a_shell(tmp_path, value, monkeypatch):
    """The run directory is the one free string on the command line: one argv element; in a batch script only when
    it has the checked path shape."""
    from dsrecipes.boundary.values import path_problem
    from dsrecipes.core.errors import ConfigError
    from dsrecipes.run import launch

    monkeypatch.chdir(tmp_path)
    run_dir = (tmp_path / value).resolve()
    for kind in LauncherKind:
        cfg = for_kind(TrainConfig(), kind)
        if kind is LauncherKind.slurm and path_problem(str(run_dir)):
            with pytest.raises(ConfigError, match="trainer.output_dir"):
                launch.build_plan(cfg, run_dir, master_port=29511, environ={})
            continue
        plan = launch.build_plan(cfg, run_dir, master_port=29511, environ={})
        assert not leaks(plan, run_dir)
        if kind is not LauncherKind.slurm:  # (sbatch SCRIPT: the script holds it, quoted)
            assert any(c.argv[c.argv.index("--run-dir") + 1] == str(run_dir) for c in plan.commands)
