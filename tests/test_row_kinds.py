"""Objectives declare the rows they train on; the data layer asks for the row kind, never for the objective.

- no module under dsrecipes/data/ names `ObjectiveKind` or reads `objective.kind` (AST: names, attributes, imports);
- every objective's option file declares `rows`, the same `RowKind` its objective module declares (`row_kind`);
- overriding `objective.rows` against the objective is refused, naming the key.
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


def test_every_layer_of_the_data_layer_has_each_row_kind():
    """Reading, checking, scanning and sharding are tables by row kind: a new kind fails here until each layer
    serves it (no `if pairs ... else` that would silently treat it as a conversation)."""
    from dsrecipes.data.prepare.build import PREPARATIONS
    from dsrecipes.data.shard.rows import FORMATS
    from dsrecipes.data.sources.samples import SOURCES
    from dsrecipes.data.strategies.rows import ROW_ENCODERS
    from dsrecipes.data.stream.scan import READINGS

    for table in (FORMATS, ROW_ENCODERS, READINGS, PREPARATIONS, SOURCES):
        assert set(table) == set(RowKind), table
    assert len(set(FORMATS.values())) == len(RowKind)
