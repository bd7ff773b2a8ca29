"""The README as a first-day user reads it: its tables name what the config tree holds (every group option, every
shipped recipe), and every `python -m dsrecipes ...` line of "Everyday use" that runs with plain overrides validates
as written (run from a folder holding the data files the lines name)."""

from __future__ import annotations

import json
import re
import shlex

from dsrecipes.cli import main
from dsrecipes.config.groups import group_options
from tests.conftest import REPO, in_process_environ

README = (REPO / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    return README.split(f"\n{title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_config_groups_table_names_every_option_of_every_group():
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \| ", _section("## Config groups"), re.M)
    assert len(rows) >= 12, rows
    for group, cell in rows:
        if group == "debug":
            continue
        named = {w.strip() for w in re.sub(r"\(.*?\)", "", cell).split(",")}
        assert named == set(group_options()[group]), (group, named)


def test_the_recipes_table_names_every_shipped_recipe():
    named = set(re.findall(r"^\| `(\w+)` \| ", _section("## Recipes"), re.M))
    assert named == {p.stem for p in (REPO / "recipes").glob("*.yaml")}, named


def test_the_everyday_commands_validate_as_written(tmp_path, monkeypatch, capsys):
    lines = re.search(r"## Everyday use\n\n```bash\n(.*?)```", README, re.S).group(1).splitlines()
    commands = [shlex.split(line, comments=True)[3:] for line in lines if line.startswith("python -m dsrecipes")]
    runnable = [c for c in commands if not any(w.startswith("-") or w.startswith("recipe=./") for w in c)]
    assert len(runnable) >= 8 and ["model.lora.enabled=true"] in runnable, runnable
    data = tmp_path / "data"
    data.mkdir()
    chat = {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}
    # enough rows for the default dataset.val_size (64) to leave most to train on: validate counts them
    (data / "my_chats.json").write_text(json.dumps([chat] * 100))
    (data / "my_alpaca.json").write_text(json.dumps([{"instruction": "2+2?", "input": "", "output": "4"}] * 100))
    (data / "dataset_info.json").write_text(json.dumps({"a": {"file_name": "my_chats.json", "formatting": "sharegpt"},
                                                        "b": {"file_name": "my_alpaca.json"}}))
    monkeypatch.chdir(tmp_path)
    for args in runnable:
        with in_process_environ():
            code = main(["validate", *args])
        out = capsys.readouterr()
        assert code == 0 and "OK:" in out.out, (args, out.err[-2000:])


def test_every_group_option_the_docs_name_exists():
    """`offload=cpu` in docs/architecture.md named no option (cpu_optimizer, cpu_optimizer_params)."""
    groups = {g: o for g, o in group_options().items() if g != "recipe"}  # a recipe may be a file of one's own
    pattern = re.compile(rf"(?<![\w.])({'|'.join(groups)})=(\w+)")
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for span in re.findall(r"`([^`\n]+)`", doc.read_text(encoding="utf-8")):
            for group, option in pattern.findall(span):
                assert option in groups[group] or option == "NAME", (doc.name, span)


def test_the_architecture_map_names_every_subcommand():
    from dsrecipes.cli import SUBCOMMANDS

    doc = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    row = re.search(r"^\| `commands/` \|.*$", doc, re.M).group(0)
    assert {n for n in SUBCOMMANDS if f"`{n}`" not in row} == set(), row


def test_the_printed_summary_shows_the_next_commands_a_run_prints(tmp_path):
    """README "What a run prints": the `next:` lines a finished run with an export prints, in its order."""
    from dsrecipes.observe.report import next_commands

    block = re.search(r"## What a run prints.*?```text\n(.*?)```", README, re.S).group(1)
    shown = re.findall(r"^  (\w[\w ]*:) ", block.split("next:\n", 1)[1], re.M)
    (tmp_path / "export").mkdir()
    assert shown == [label for label, _ in next_commands(tmp_path, [], 400, 400)], shown
