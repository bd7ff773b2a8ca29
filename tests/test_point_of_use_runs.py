"""Check at the point of use on real runs (issue 50 items 3 and 5): a checkpoint file replaced right after the
launching process wrote plan.json (its check passed) is refused by the rank that would unpickle it - one message,
exit 2, the payload never runs; a signed tag renamed to another step is refused; `export --out` into a checkpoint is
refused before anything is written.

One base run (tiny model, 8 steps, checkpoints at 4 and 8) is shared; each case works on a copy.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.test_hostile_checkpoint import one_error
from tests.test_run_ownership import dsrecipes, snapshot
from tests.test_run_safety import base, copy_run, train, ws  # noqa: F401  (the session-scoped workspace and base run)
from tests.test_trust import Payload

pytestmark = pytest.mark.slow

STATES = "mp_rank_00_model_states.pt"


def test_a_file_replaced_after_plan_json_is_written_never_runs(ws, base, tmp_path, monkeypatch):  # noqa: F811
    """The attack of issue 50: the launching process checked step_8 and wrote plan.json; then the model states are
    replaced by a pickle payload (complete.json untouched, still signed). The rank checks again and refuses."""
    import dsrecipes.run.entry as entry

    run = copy_run(base, ws / "swapped")
    tag = run / "checkpoints" / "step_8"
    marker = tmp_path / "payload_ran"
    planned = entry.write_plan

    def write_plan_then_swap(run_dir, plan):
        written = planned(run_dir, plan)
        states = torch.load(tag / STATES, weights_only=True)
        torch.save({**states, "extra": Payload(marker)}, tag / "new.pt")
        os.replace(tag / "new.pt", tag / STATES)
        return written

    monkeypatch.setattr(entry, "write_plan", write_plan_then_swap)
    code, out = train(ws, run, "trainer.max_steps=12")
    assert code == 2, out[-3000:]
    assert f"{tag / STATES}: " in one_error(out) and "checked right before loading it" in out
    assert not marker.exists()
    assert not (run / "checkpoints" / "step_12").exists()


def test_a_signed_tag_renamed_to_another_step_is_refused(ws, base):  # noqa: F811
    run = copy_run(base, ws / "renamed")
    shutil.rmtree(run / "checkpoints" / "step_8")
    os.rename(run / "checkpoints" / "step_4", run / "checkpoints" / "step_12")
    before = snapshot(run)
    code, out = train(ws, run, "trainer.max_steps=16", f"trainer.resume_from={run / 'checkpoints' / 'step_12'}")
    assert code == 2 and "records step 4, but the directory is named step_12" in one_error(out)
    assert "resuming from step 12" not in out and snapshot(run) == before


def test_export_into_a_checkpoint_is_refused(ws, base, tmp_path):  # noqa: F811
    before = snapshot(base)
    for out_dir in (base / "checkpoints" / "step_8" / "x", base / "checkpoints" / "x", base / "checkpoints"):
        code, out = dsrecipes("export", str(base), "--out", str(out_dir), cwd=tmp_path)
        assert code == 2 and "inside the checkpoints" in one_error(out), out[-2000:]
    assert snapshot(base) == before


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]", '{"loss": 1.0}', b"\xff\xfe"])
def test_a_damaged_metrics_line_is_one_message_naming_file_and_line(ws, base, bad):  # noqa: F811
    run = copy_run(base, ws / "damaged_metrics")
    try:
        metrics = run / "metrics.jsonl"
        lines = metrics.read_bytes().splitlines(keepends=True)
        bad = bad if isinstance(bad, bytes) else bad.encode()
        metrics.write_bytes(b"".join(lines[:2]) + bad + b"\n" + b"".join(lines[2:]))
        code, out = train(ws, run, "trainer.max_steps=12")
        assert code == 2 and f"{metrics}:3: not a metrics record" in one_error(out), out[-3000:]
        result = json.loads((run / "result.json").read_text())
        assert result["status"] != "ok" and f"{metrics}:3" in (result.get("error") or result.get("metrics_error"))
    finally:
        shutil.rmtree(run)


def test_pickled_weights_in_model_path_are_refused_in_one_message(ws, tmp_path):  # noqa: F811
    """A model directory with pytorch_model.bin only: refused by the loader (one message), not a traceback."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.modeling.model import build_tiny_model, load_tokenizer

    cfg = compose_and_load(["debug=fast"])
    tokenizer = load_tokenizer(cfg)
    model_dir = tmp_path / "pickled"
    model = build_tiny_model(cfg, tokenizer)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    for weights in model_dir.glob("*.safetensors"):
        weights.unlink()
    torch.save(model.state_dict(), model_dir / "pytorch_model.bin")
    assert (model_dir / "pytorch_model.bin").is_file() and not list(model_dir.glob("*.safetensors"))
    code, out = train(ws, tmp_path / "run", f"model.path={model_dir}")
    assert code == 2 and "holds its weights as pickles (pytorch_model.bin)" in one_error(out), out[-3000:]
