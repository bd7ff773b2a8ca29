"""Checkpoints are data, not code (issue 21 item 2), on a real run: a run directory whose checkpoint carries a pickle
payload, with every hash in complete.json recomputed, is refused by export, resume (auto and trainer.resume_from),
chat and prompt-eval before anything unpickles it (the payload's marker file never appears), with exit 2 and one
message naming --trust-checkpoint. With --trust-checkpoint the payload is still refused, by the pickle screen
(safe_load.py) and weights_only loads; a clean checkpoint that is merely unsigned loads with the flag.

One base run (tiny model, 8 steps, checkpoints at 4 and 8, an export) is shared; each case poisons a copy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.test_run_ownership import dsrecipes, snapshot
from tests.test_run_safety import base, copy_run, losses, train, ws  # noqa: F401  (the session-scoped workspace and base run)
from tests.test_trust import Payload

pytestmark = pytest.mark.slow


def poison(run: Path, marker: Path, sign_with: Path | None = None, monkeypatch=None) -> Path:
    """step_8's model states carry a payload; complete.json lists the new hashes (unsigned, or signed with another
    user's key `sign_with`). Returns the checkpoint."""
    from dsrecipes.boundary import trust
    from dsrecipes.core.manifest import describe

    tag = run / "checkpoints" / "step_8"
    states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)
    torch.save({**states, "extra": Payload(marker)}, tag / "mp_rank_00_model_states.pt")
    record = json.loads((tag / "complete.json").read_text())
    record = {**record, "files": describe(tag, skip=["complete.json"])}
    record.pop(trust.SIGNATURE)
    if sign_with is not None:
        monkeypatch.setenv(trust.KEY_ENV, str(sign_with))
        record = trust.sign(record)
        monkeypatch.delenv(trust.KEY_ENV)
    (tag / "complete.json").write_text(json.dumps(record))
    return tag


def one_error(out: str) -> str:
    assert "Traceback" not in out and out.count("error:") == 1, out[-3000:]
    return out


@pytest.mark.parametrize("signed", ["unsigned", "another_key"])
def test_a_pickle_payload_with_recomputed_hashes_is_refused_everywhere(ws, base, tmp_path, signed, monkeypatch):  # noqa: F811
    marker = tmp_path / "payload_ran"
    run = copy_run(base, ws / f"poisoned_{signed}")
    tag = poison(run, marker, tmp_path / "other.key" if signed == "another_key" else None, monkeypatch)
    why = "it is not signed" if signed == "unsigned" else "its signature does not match this user's key"
    before = snapshot(run)

    code, out = dsrecipes("export", str(run), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert code == 2 and why in one_error(out) and f"--trust-checkpoint {tag}" in out
    assert not (tmp_path / "out").exists()
    for override in ([f"trainer.resume_from={tag}"], [f"trainer.resume_from={run}"], []):  # resume=auto too
        code, out = train(ws, run, *override)
        assert code == 2 and why in one_error(out) and "dsrecipes train ... --trust-checkpoint" in out
    code, out = train(ws, tmp_path / "new" / "run", f"trainer.resume_from={tag}")  # a new run directory: ...
    assert code == 2 and why in one_error(out) and not (tmp_path / "new").exists()  # ... taken back, parents too
    # chat and prompt-eval on the run directory read its export (signed, untouched), never its checkpoints
    code, out = dsrecipes("chat", str(run), "--message", "hi", "--max-new-tokens", "2", cwd=tmp_path)
    assert code == 0, out[-2000:]
    assert not marker.exists() and snapshot(run) == before

    # Trusted on the command line: the hashes verify, but the pickle screen still refuses the payload.
    code, out = dsrecipes("export", str(run), "--out", str(tmp_path / "out"), "--trust-checkpoint", str(tag),
                          cwd=tmp_path)
    assert code == 2 and "its pickle imports posix.system" in one_error(out) and not (tmp_path / "out").exists()
    code, out = train(ws, run, f"trainer.resume_from={tag}", "--trust-checkpoint", str(tag))
    assert code == 2 and "its pickle imports posix.system" in one_error(out)
    assert not marker.exists() and snapshot(run) == before


def test_an_unsigned_clean_checkpoint_loads_only_with_the_flag(ws, base, tmp_path):  # noqa: F811
    """What --trust-checkpoint is for: a colleague's checkpoint (here: the signature removed). It exports and
    resumes with the flag, and nothing is re-signed."""
    from dsrecipes.core.runplan import read_plan

    run = copy_run(base, ws / "colleague")
    tag = run / "checkpoints" / "step_8"
    record = json.loads((tag / "complete.json").read_text())
    del record["signature"]
    (tag / "complete.json").write_text(json.dumps(record))
    code, out = dsrecipes("export", str(run), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert code == 2 and "it is not signed" in one_error(out)
    code, out = dsrecipes("export", str(run), "--out", str(tmp_path / "out"), "--trust-checkpoint", str(run),
                          cwd=tmp_path)
    assert code == 0 and (tmp_path / "out" / "model.safetensors").is_file(), out[-2000:]
    code, out = train(ws, run, "trainer.max_steps=12", "launcher.dry_run=true", "--trust-checkpoint", str(tag))
    assert code == 0 and read_plan(run).resume.checkpoint == str(tag), out[-2000:]
    # and for real: every file of it loads, its RNG states included (numpy's types were taken off torch's
    # weights-only list by the pickle screen of a trusted file, and rng/rank0.pt was refused)
    code, out = train(ws, run, "trainer.max_steps=10", "--trust-checkpoint", str(tag))
    assert code == 0, out[-2000:]
    assert sorted(losses(run))[-2:] == [9, 10]
    assert "signature" not in json.loads((tag / "complete.json").read_text())  # trusting re-signed nothing


def test_chat_and_prompt_eval_refuse_a_poisoned_export_of_a_run(ws, base, tmp_path):  # noqa: F811
    """The run's export has its weights replaced by a pickle payload and its marker's hashes recomputed."""
    from dsrecipes.core.manifest import describe

    marker = tmp_path / "payload_ran"
    run = copy_run(base, ws / "poisoned_export")
    export = run / "export"
    (export / "model.safetensors").unlink()
    torch.save({"w": Payload(marker)}, export / "pytorch_model.bin")
    info = json.loads((export / "dsrecipes_export.json").read_text())
    info["hashes"] = describe(export, skip=["dsrecipes_export.json"])
    info["files"] = sorted(info["hashes"])
    (export / "dsrecipes_export.json").write_text(json.dumps(info))
    for argv in (["chat", str(run), "--message", "hi"], ["prompt-eval", "--finetuned", str(run), "--limit", "1"]):
        code, out = dsrecipes(*argv, cwd=tmp_path)
        assert code == 2 and "its signature does not match this user's key" in one_error(out)
        assert f"--trust-checkpoint {export}" in out
        code, out = dsrecipes(*argv, "--trust-checkpoint", str(run), cwd=tmp_path)  # weights_only still refuses
        assert code == 2 and "a pickle that holds more than tensors" in one_error(out)
    assert not marker.exists()


def test_export_refuses_a_base_model_that_needs_its_own_code(ws, base, tmp_path):  # noqa: F811
    """The run's model.path (the base its weights go onto) gained an auto_map: export refuses it, nothing runs."""
    from dsrecipes.core.paths import TINY_TOKENIZER_DIR

    run = copy_run(base, ws / "custom_base")
    custom = tmp_path / "custom"
    shutil.copytree(TINY_TOKENIZER_DIR, custom)
    (custom / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {
        "AutoModelForCausalLM": "modeling_x.X"}}))
    (custom / "modeling_x.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    config = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(config.replace("  path: null\n", f"  path: {custom}\n", 1))
    code, out = dsrecipes("export", str(run), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert code == 2 and f"model.path: {custom} needs its own Python code to load" in one_error(out), out[-2000:]
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def test_a_pickle_added_beside_a_signed_checkpoint_is_not_loaded(ws, base, tmp_path):  # noqa: F811
    """complete.json stays signed and untouched; a shard a loader would glob for is added next to the others."""
    marker = tmp_path / "payload_ran"
    run = copy_run(base, ws / "planted")
    tag = run / "checkpoints" / "step_8"
    torch.save({"x": Payload(marker)}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    planted = "zero_pp_rank_0_mp_rank_00_optim_states.pt: not part of the checkpoint as it was written"
    code, out = train(ws, run, f"trainer.resume_from={tag}")
    assert code == 2 and planted in one_error(out)
    code, out = dsrecipes("export", str(run), "--tag", "step_8", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert code == 2 and planted in one_error(out) and not (tmp_path / "out").exists()
    assert not marker.exists()


@pytest.mark.parametrize("hashes", [[], {"model.safetensors": 5}, {"../config.json": {"size": 1, "hash": "x"}}])
def test_an_export_marker_of_the_wrong_shape_is_a_damaged_export(ws, base, tmp_path, hashes, monkeypatch):  # noqa: F811
    """dsrecipes_export.json's `hashes` from someone else (trusted on the command line): a list used to skip the
    check and load whatever was there; any wrong shape is now one message before anything is read."""
    from dsrecipes.boundary import trust
    from dsrecipes.core.errors import UserError
    from dsrecipes.serve.inference import check_loadable

    export = copy_run(base / "export", tmp_path / "export")
    info = json.loads((export / "dsrecipes_export.json").read_text())
    (export / "dsrecipes_export.json").write_text(json.dumps({**info, "hashes": hashes}))
    monkeypatch.setattr(trust, "check", lambda *a, **k: False)  # (trusted: the shape is what is under test)
    with pytest.raises(UserError, match=r"damaged export \(dsrecipes_export.json: hashes"):
        check_loadable(export, "retry")


@pytest.mark.parametrize("case", ["position of another shape", "train_state of another shape"])
def test_a_trusted_checkpoints_contents_of_another_shape_are_one_message(ws, base, tmp_path, case):  # noqa: F811
    """--trust-checkpoint vouches for where a checkpoint came from, not for its contents: a colleague's data position
    (`data_state/rank0.json`) with keys no loader wrote, or DeepSpeed client_state whose train_state has an unknown
    key, was a KeyError/TypeError traceback from the rank (exit 1). Now one message naming the file, exit 2."""
    from dsrecipes.boundary import trust
    from dsrecipes.core.manifest import describe

    run = copy_run(base, ws / f"shape_{case.split()[0]}")
    tag = run / "checkpoints" / "step_8"
    if case.startswith("position"):
        state_file = tag / "data_state" / "rank0.json"
        state = json.loads(state_file.read_text())
        state["position"] = {**state["position"], "not_a_field": 1}
        state_file.write_text(json.dumps(state))
        named = str(state_file)
    else:
        states_file = tag / "mp_rank_00_model_states.pt"
        states = torch.load(states_file, weights_only=True)
        states["train_state"] = {**states["train_state"], "not_a_field": 1}
        torch.save(states, states_file)
        named = f"{tag}: its train_state"
    record = json.loads((tag / "complete.json").read_text())
    record = {**record, "files": describe(tag, skip=["complete.json"])}
    record.pop(trust.SIGNATURE)
    (tag / "complete.json").write_text(json.dumps(record))
    code, out = train(ws, run, "trainer.max_steps=10", f"trainer.resume_from={tag}", "--trust-checkpoint", str(tag))
    assert code == 2, out[-3000:]
    assert named in one_error(out) and "not as dsrecipes writes it" in out, out[-3000:]
