"""Objectives declare the rows they train on; the data layer asks for the row kind, never for the objective.

- no module under dsrecipes/data/ names `ObjectiveKind` or reads `objective.kind` (AST: names, attributes, imports);
- every objective's option file declares `rows`, the same `RowKind` its objective module declares (`row_kind`);
- overriding `objective.rows` against the objective is refused, naming the key.
- what each row kind is, for every layer of data/, is said once (`data/rowkinds.py` `ROW_KINDS`): complete, every
  part importable, and one canonical row layout for every kind.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dsrecipes.core.schema import ObjectiveKind, RowKind

DATA = Path(__file__).resolve().parents[1] / "dsrecipes" / "data"


def _objective_kind_uses(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "ObjectiveKind":
            yield node.lineno, "ObjectiveKind"
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] == "ObjectiveKind":
            yield getattr(node, "lineno", 0), "import ObjectiveKind"
        elif isinstance(node, ast.Attribute) and node.attr == "ObjectiveKind":
            yield node.lineno, "ObjectiveKind"
        elif (isinstance(node, ast.Attribute) and node.attr == "kind" and isinstance(node.value, ast.Attribute)
              and node.value.attr == "objective"):
            yield node.lineno, "objective.kind"


def test_the_data_layer_never_asks_for_the_objective():
    bad = [f"{p.relative_to(DATA.parent.parent)}:{line}: {what}" for p in sorted(DATA.rglob("*.py"))
           for line, what in _objective_kind_uses(p)]
    assert not bad, "the data layer reads rows by objective.rows (RowKind), not by the objective:\n" + "\n".join(bad)


def test_the_check_sees_what_it_refuses(tmp_path):
    """The AST check catches each way the old code asked (so an empty result above means something)."""
    probe = tmp_path / "probe.py"
    probe.write_text("from dsrecipes.core.schema import ObjectiveKind\n"
                     "def f(cfg):\n    return cfg.objective.kind is ObjectiveKind.dpo\n")
    found = sorted(w for _, w in _objective_kind_uses(probe))
    assert found == ["ObjectiveKind", "import ObjectiveKind", "objective.kind"]


@pytest.mark.parametrize("kind", list(ObjectiveKind))
def test_each_objective_declares_its_rows_in_module_and_option_file(kind, make_cfg):
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.objectives import build_objective

    cfg = make_cfg(f"objective={kind.value}")
    assert isinstance(cfg.objective.rows, RowKind)
    objective = build_objective(cfg, load_tokenizer(cfg))
    assert objective.row_kind is cfg.objective.rows


def test_rows_overridden_against_the_objective_are_refused(make_cfg):
    from dsrecipes.core.errors import ConfigError
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.objectives import build_objective

    cfg = make_cfg("objective=sft", "objective.rows=pair", check_files=False)
    with pytest.raises(ConfigError, match=r"objective\.rows: objective=sft trains on conversation rows"):
        build_objective(cfg, load_tokenizer(cfg))


def _incomplete(table):
    """What the row-kind registry lacks: a RowKind with no entry, a part left empty, a named part that does not
    import, a kind without its token columns, two kinds with one row format."""
    import dataclasses

    from dsrecipes.data.rowkinds import RowKindSpec, resolved

    problems = [f"{kind.value}: no entry" for kind in RowKind if kind not in table]
    for kind, spec in table.items():
        assert isinstance(spec, RowKindSpec), kind
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            if value in ("", ()) and field.name not in ("reader", "settings"):
                problems.append(f"{kind.value}.{field.name}: empty")
            elif isinstance(value, str) and ":" in value:
                try:
                    resolved(value)
                except (ImportError, AttributeError) as e:
                    problems.append(f"{kind.value}.{field.name}: {value} does not resolve ({e})")
        if bool(spec.reader) is (kind is RowKind.conversation):
            problems.append(f"{kind.value}.reader: conversations alone are read without a SampleKind")
    formats = [spec.row_format for spec in table.values()]
    if len(set(formats)) != len(formats):
        problems.append(f"row formats repeat: {formats}")
    return problems


def test_one_registry_says_what_each_row_kind_is():
    """Reading, checking, scanning, sharding and loading look a kind up in `rowkinds.ROW_KINDS`: every RowKind has
    an entry with every part, and each part it names imports (a new kind fails here until each layer serves it;
    no `if pairs ... else` that would silently treat it as a conversation). Map preparation and the config rules
    keep their own tables by kind, checked complete here too."""
    from dsrecipes.config.objective_rules import ROW_RULES
    from dsrecipes.data.prepare.build import PREPARATIONS
    from dsrecipes.data.rowkinds import ROW_KINDS

    assert _incomplete(ROW_KINDS) == []
    for table in (PREPARATIONS, ROW_RULES):
        assert set(table) == set(RowKind), table


def test_the_registry_check_sees_what_it_refuses():
    """A missing kind, an empty part, a part that does not import and a repeated format are each reported."""
    import dataclasses

    from dsrecipes.data.rowkinds import ROW_KINDS

    pair = ROW_KINDS[RowKind.pair]
    broken = {RowKind.conversation: dataclasses.replace(ROW_KINDS[RowKind.conversation], checker=""),
              RowKind.pair: dataclasses.replace(pair, loader=pair.loader + "_gone",
                                                row_format=ROW_KINDS[RowKind.conversation].row_format)}
    got = _incomplete(broken)
    assert got[0] == "prompt: no entry" and "conversation.checker: empty" in got
    assert any(p.startswith("pair.loader: ") and "does not resolve" in p for p in got)
    assert any(p.startswith("row formats repeat") for p in got), got


def test_every_kind_is_written_in_the_one_canonical_layout():
    """A conversation is the prompt of a pair or a prompt row with no columns of its own: `dsrecipes shard` writes
    every kind through `samples.canonical_row`, key order included."""
    from dsrecipes.data.rowkinds import ROW_KINDS, resolved
    from dsrecipes.data.sources.preference import Pair
    from dsrecipes.data.sources.prompts import Prompt
    from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

    conv = Conversation("a.jsonl:3", [Turn(Role.user, "hi")], "be brief", None)
    write = {kind: resolved(spec.canonical) for kind, spec in ROW_KINDS.items()}
    plain = write[RowKind.conversation](conv)
    assert list(plain) == ["id", "conversations", "system"]
    assert plain["conversations"] == [{"from": "user", "value": "hi"}]
    pair = write[RowKind.pair](Pair(conv, "yes", "no"))
    assert list(pair) == ["id", "conversations", "chosen", "rejected", "system"]
    assert {k: pair[k] for k in plain} == plain
    prompt = write[RowKind.prompt](Prompt(conv, "42"))
    assert list(prompt) == ["id", "conversations", "system", "reference"] and prompt["reference"] == "42"
