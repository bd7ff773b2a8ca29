"""The trust decisions of one invocation end with it: `trust.reset()` (each command line in cli.main, each stage of a
pipeline) leaves nothing of the previous one behind - the paths its command line trusted, the records accepted only
because of them, the exports it accepted (pinned for its ranks), a rank's launch pins, the command a refusal names.
A guard for boundary/trust.py's state (one Invocation object since it replaced five module-level holders)."""

from __future__ import annotations

import json

import pytest

from dsrecipes.boundary import trust
from dsrecipes.core.export_dir import EXPORT_INFO
from dsrecipes.core.manifest import describe


def _unsigned_export(path):
    """A directory that is a dsrecipes export (its files as listed) whose record nobody signed."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}", encoding="utf-8")
    record = {"run": "elsewhere", "hashes": describe(path)}
    (path / EXPORT_INFO).write_text(json.dumps(record), encoding="utf-8")
    return path.resolve(), trust.record_pin(record)


def test_reset_leaves_nothing_of_the_previous_invocation(tmp_path, monkeypatch):
    monkeypatch.setenv(trust.KEY_ENV, str(tmp_path / "key"))
    trust.ensure_key()
    theirs, export = tmp_path / "theirs", tmp_path / "theirs" / "export"
    checkpoint = theirs / "checkpoints" / "step_4"
    checkpoint.mkdir(parents=True)
    export, pin = _unsigned_export(export)
    trust.reset()
    try:  # one invocation: `dsrecipes validate ... --trust-checkpoint THEIRS`, then a rank of its launch
        trust.trust([str(theirs)], "dsrecipes validate ...")
        assert trust.check({"step": 4}, checkpoint, "checkpoint", "x") is False  # relied on the flag
        trust.check_export(export, "x")  # accepted (trusted), pinned
        assert trust.accepted_exports() == {str(export): pin}
        assert trust.repeat_flags(lambda what, where: True) == [trust.FLAG, str(theirs.resolve())]
        assert trust.run_command() == "dsrecipes validate ..." and trust.is_trusted(checkpoint)
        with trust.launched({str(export): pin}):
            trust.check_export(export, "x")
    finally:
        trust.reset()
    assert not trust.is_trusted(checkpoint) and trust.repeat_flags(lambda what, where: True) == []
    assert trust.accepted_exports() == {} and trust.run_command() == "dsrecipes train ..."
    with pytest.raises(trust.Untrusted, match="refusing to load this checkpoint"):
        trust.check({"step": 4}, checkpoint, "checkpoint", "x")
    with pytest.raises(trust.Untrusted, match="refusing to load this export"):  # no command line, no launch pin
        trust.check_export(export, "x")
    assert trust.accepted_exports() == {}
    trust.trust([str(theirs)])  # the next invocation trusts the same PATH: it relied on nothing yet
    try:
        assert trust.repeat_flags(lambda what, where: True) == []
    finally:
        trust.reset()
