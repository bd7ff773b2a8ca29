"""Checkpoints and exports publish through core/publish.py (issue 42 item 3): re-saving a tag or replacing an export
exchanges whole directories in one step, so the final path never names nothing (checkpoint.commit used to rename the
old tag aside first)."""

from __future__ import annotations

import json

import dsrecipes.core.publish as publish
from dsrecipes.rank.checkpoint import commit
from tests.test_trust import key_file  # noqa: F401  (fixture)


def test_resaving_a_tag_exchanges_the_whole_directory(key_file, tmp_path, monkeypatch):  # noqa: F811
    (tmp_path / "config.yaml").write_text("trainer: {}\n")
    final = tmp_path / "checkpoints" / "step_8"
    final.mkdir(parents=True)
    (final / "old.pt").write_bytes(b"old")
    staging = tmp_path / "checkpoints" / "step_8.partial"
    staging.mkdir()
    (staging / "new.pt").write_bytes(b"new")
    seen = []
    exchange = publish.exchange

    def watched(new, old):
        exchange(new, old)
        seen.append(sorted(p.name for p in old.iterdir()))  # right after the swap: the new checkpoint, whole

    monkeypatch.setattr(publish, "exchange", watched)
    commit(tmp_path, staging, final, {"step": 8, "world_size": 1})
    assert seen == [["complete.json", "config.yaml", "new.pt"]]
    assert sorted(p.name for p in final.iterdir()) == ["complete.json", "config.yaml", "new.pt"]
    assert not staging.exists() and (tmp_path / "checkpoints" / "latest").read_text() == "step_8"
    assert json.loads((final / "complete.json").read_text())["step"] == 8
