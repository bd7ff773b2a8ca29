"""The validation tables are complete: every launcher has its row of rules, every row kind and every objective its
rules; the rules found through the tables are the ones validation reports (one message per broken rule, keyed)."""

from __future__ import annotations

import pytest

from dsrecipes.config import launcher_rules, objective_rules
from dsrecipes.config.load import check_composition, compose
from dsrecipes.core.schema import LauncherKind, ObjectiveKind, RowKind


def test_every_launcher_has_its_row():
    assert set(launcher_rules.RULES) == set(LauncherKind)


def test_every_objective_and_row_kind_has_its_row():
    assert set(objective_rules.RULES) == set(ObjectiveKind)
    assert set(objective_rules.ROW_RULES) == set(RowKind)


def problems_of(*overrides: str):
    """What validation reports for the composition (the tables' messages must reach it)."""
    cfg, schema_errors, rule_errors = check_composition(compose(list(overrides)), check_files=False)
    assert cfg is not None and not schema_errors, schema_errors
    return rule_errors


@pytest.mark.parametrize("kind", [k for k in LauncherKind if k is not LauncherKind.deepspeed])
def test_device_selection_belongs_to_deepspeed_alone(kind):
    problems = problems_of(f"launcher={kind.value}", "launcher.num_gpus=1", "launcher.include=localhost:0")
    assert f"launcher.include: --include/--exclude exist only for launcher=deepspeed, not {kind.value}" in problems


def test_each_launcher_row_holds_its_own_rules():
    two_nodes = ("launcher.num_nodes=2", "launcher.num_gpus=1")
    expect = {
        "deepspeed": "launcher.hostfile: launcher=deepspeed on several nodes needs a hostfile",
        "mpirun": "launcher.hostfile: mpirun on several nodes needs a hostfile",
        "torchrun": "launcher.rdzv_endpoint: torchrun on several nodes needs a rendezvous host:port",
        "local": "launcher.kind: the local launcher runs one process",
    }
    for kind, message in expect.items():
        problems = problems_of(f"launcher={kind}", *two_nodes)
        assert any(p.startswith(message) for p in problems), (kind, problems)
        others = {k: m for k, m in expect.items() if k != kind}
        assert not any(p.startswith(m) for p in problems for m in others.values()), (kind, problems)


def test_pair_rules_come_from_the_row_kind_and_dpo_rules_from_the_objective():
    problems = problems_of("objective=dpo", "data.packing=true", "objective.label_smoothing=0.7", "objective.loss=robust")
    assert any(p.startswith("data.packing: objective=dpo trains on whole pairs") for p in problems)
    assert any(p.startswith("objective.label_smoothing: must be in [0, 0.5)") for p in problems)
    orpo = problems_of("objective=orpo", "data.packing=true", "objective.label_smoothing=0.7")
    assert [p for p in orpo if p.startswith(("data.packing", "objective."))] == [
        "data.packing: objective=orpo trains on whole pairs; set data.packing=false"]
