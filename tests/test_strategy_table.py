"""The DataStrategy seam: every `DataKind` has one complete strategy, and nothing outside data/strategies/ asks which
data kind a run uses (no `DataKind` branch), so adding a strategy is one module, one option file, one Enum value."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from dsrecipes.core.errors import DataError
from dsrecipes.core.schema import DataKind
from dsrecipes.data.strategies import STRATEGIES, DataStrategy
from dsrecipes.data.strategies.rules import RULES

PACKAGE = Path(__file__).resolve().parents[1] / "dsrecipes"
STRATEGY_DIR = PACKAGE / "data" / "strategies"
PROTOCOL_METHODS = sorted(n for n, v in vars(DataStrategy).items() if callable(v) and not n.startswith("_"))
CONF_DATA = PACKAGE.parent / "conf" / "data"


def test_the_protocol_names_the_seam():
    assert PROTOCOL_METHODS == ["audit", "eval_loader", "identity", "open", "prepare", "steps_per_epoch",
                                "train_loader"]


@pytest.mark.parametrize("kind", list(DataKind))
def test_every_data_kind_has_a_complete_strategy(kind):
    strategy = STRATEGIES[kind]
    assert strategy.kind is kind and isinstance(strategy.needs_tokenizer, bool)
    for name in PROTOCOL_METHODS:
        own = getattr(type(strategy), name, None)
        assert own is not None and own is not getattr(DataStrategy, name), f"{kind.value}: {name} not implemented"
        want = list(inspect.signature(getattr(DataStrategy, name)).parameters)
        assert list(inspect.signature(own).parameters) == want, f"{kind.value}.{name}: signature differs"
    assert kind in RULES, f"{kind.value}: no config rules in data/strategies/rules.py"
    assert (CONF_DATA / f"{kind.value}.yaml").is_file(), f"conf/data/{kind.value}.yaml missing"


def test_the_tables_hold_nothing_else():
    assert set(STRATEGIES) == set(DataKind) == set(RULES)
    assert len({type(s) for s in STRATEGIES.values()}) == len(DataKind)  # one class per kind


def _kind_branches(path: Path):
    """Every `DataKind.<member>` reference, and every comparison of something called `kind`/`data_kind` with a
    DataKind value as a string, in one module."""
    values = {k.value for k in DataKind}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "DataKind":
            yield node.lineno, f"DataKind.{node.attr}"
        if isinstance(node, ast.Compare):
            text = ast.unparse(node)
            consts = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}
            if "kind" in text and consts & values:
                yield node.lineno, text
        if isinstance(node, ast.Match) and "kind" in ast.unparse(node.subject):
            for case in node.cases:
                consts = {n.value for n in ast.walk(case.pattern) if isinstance(n, ast.Constant)}
                if consts & values:
                    yield case.pattern.lineno, f"match {ast.unparse(node.subject)}: case {ast.unparse(case.pattern)}"


def test_no_data_kind_branch_outside_the_strategies():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if STRATEGY_DIR in path.parents:
            continue
        for line, what in _kind_branches(path):
            if path.name == "schema.py" and what == "DataKind.map":
                continue  # the field's default (DataConfig.kind), not a branch
            found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert found == []


def test_the_branch_finder_finds_branches(tmp_path):
    """The check above would see the branches this seam removed (a guard against a finder that finds nothing)."""
    probe = tmp_path / "probe.py"
    probe.write_text("if cfg.data.kind is DataKind.presharded:\n    pass\n"
                     "if plan.data_kind == 'iterable':\n    pass\n"
                     "match cfg.data.kind.value:\n    case 'map':\n        pass\n", encoding="utf-8")
    assert sorted(line for line, _ in _kind_branches(probe)) == [1, 3, 6]


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_a_rank_never_prepares_data_itself(kind, make_cfg, tmp_path):
    """The ranks read what the launching process wrote; a run directory without it is refused, not filled in."""
    from dsrecipes.core.paths import SAMPLE_DATA_DIR
    from dsrecipes.core.runplan import RunPlan
    from dsrecipes.data.strategies import build_loaders

    cfg = make_cfg(f"data={kind}", f"dataset.paths=[{SAMPLE_DATA_DIR / 'train.jsonl'}]",
                   f"data.cache_dir={tmp_path / 'cache'}")
    plan = RunPlan(world_size=1, num_nodes=1, data_kind=kind, rows=10, steps_per_epoch=1, total_steps=1,
                   data_fingerprint="x")
    with pytest.raises(DataError, match="missing; the launching process"):
        build_loaders(cfg, None, 0, 1, tmp_path / "run", plan)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_rank_refuses_data_that_differs_from_its_plan(make_cfg, tmp_path):
    """plan.json is read once (train.start) and handed down; the stream the rank sees must have its row count."""
    import dataclasses

    from dsrecipes.core.paths import SAMPLE_DATA_DIR
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.strategies import build_loaders
    from tests.helpers.launching import plan_like_launcher

    cfg = make_cfg("data=iterable", f"dataset.paths=[{SAMPLE_DATA_DIR / 'train.jsonl'}]", "dataset.max_samples=40",
                   "dataset.val_size=0", f"data.cache_dir={tmp_path / 'cache'}", "trainer.micro_batch_size=2")
    plan = plan_like_launcher(cfg, tmp_path / "run", 1)
    assert plan.rows == 40
    tok = load_tokenizer(cfg)
    assert build_loaders(cfg, tok, 0, 1, tmp_path / "run", plan)[0].planned == 40
    with pytest.raises(DataError, match="plans 39 samples per epoch, this rank's data has 40"):
        build_loaders(cfg, tok, 0, 1, tmp_path / "run", dataclasses.replace(plan, rows=39))
