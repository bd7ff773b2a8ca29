"""Check at the point of use (issue 50 item 3), without a training run: the process that unpickles a checkpoint
checks it again right before each load (boundary/point_of_use.py), from the very descriptor it then loads.

Each hostile case swaps a file after the first check (the launching process's) and before or during the load; the
payload's marker file never appears, and the refusal is one message naming the file. The same check on real runs
(a file replaced right after plan.json is written) is in test_point_of_use_runs.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dsrecipes.boundary import point_of_use, safe_load, trust
from dsrecipes.boundary.point_of_use import ChangedCheckpoint, CheckedCheckpoint, read_pinned
from dsrecipes.core import manifest
from tests.test_trust import Payload, key_file  # noqa: F401  (fixture)

STATES = "mp_rank_00_model_states.pt"


def signed_tag(tmp_path, sign=True):
    tag = tmp_path / "checkpoints" / "step_4"
    (tag / "rng").mkdir(parents=True)
    torch.save({"module": {"w": torch.arange(4.0)}}, tag / STATES)
    torch.save({"torch": torch.zeros(3)}, tag / "rng" / "rank0.pt")
    (tag / "data_state.json").write_text(json.dumps({"pos": 7}))
    record = {"step": 4, "world_size": 1, "files": manifest.describe(tag)}
    (tag / "complete.json").write_text(json.dumps(trust.sign(record) if sign else record))
    return tag


def swap_in_payload(tag, marker, name=STATES):
    """What the attacker does: a new file renamed over the listed one (complete.json untouched, still signed)."""
    torch.save({"module": {"w": torch.arange(4.0)}, "x": Payload(marker)}, tag / "new.pt")
    os.replace(tag / "new.pt", tag / name)


def test_a_file_swapped_after_the_first_check_is_refused_before_it_is_unpickled(key_file, tmp_path):  # noqa: F811
    tag = signed_tag(tmp_path)
    marker = tmp_path / "payload_ran"
    checked = CheckedCheckpoint.open(tag, read_pinned(tag))  # the rank's open: the launcher's check passed
    swap_in_payload(tag, marker)
    with pytest.raises(ChangedCheckpoint, match=f"{STATES}: .*checked right before loading it"):
        with checked.guard():
            torch.load(str(tag / STATES), map_location="cpu", weights_only=False)  # what DeepSpeed calls
    assert not marker.exists()


def test_the_file_loaded_is_the_file_hashed(key_file, tmp_path, monkeypatch):  # noqa: F811
    """The swap lands between the hash and torch's read: the descriptor that was hashed is what torch reads."""
    tag = signed_tag(tmp_path)
    marker = tmp_path / "payload_ran"
    hashed = manifest.fd_digest

    def hash_then_swap(fd, size):
        digest = hashed(fd, size)
        swap_in_payload(tag, marker)
        return digest

    monkeypatch.setattr(point_of_use.manifest, "fd_digest", hash_then_swap)
    checked = CheckedCheckpoint.open(tag)
    with checked.guard():
        states = torch.load(str(tag / STATES), map_location="cpu", weights_only=False)
    assert set(states) == {"module"} and not marker.exists()


def test_checked_loads_of_our_own_readers(key_file, tmp_path):  # noqa: F811
    tag = signed_tag(tmp_path)
    checked = CheckedCheckpoint.open(tag)
    assert json.loads(checked.read_bytes(tag / "data_state.json")) == {"pos": 7}
    assert torch.equal(safe_load.load(tag / "rng" / "rank0.pt", checked)["torch"], torch.zeros(3))
    (tag / "data_state.json").write_text(json.dumps({"pos": 9}))
    with pytest.raises(ChangedCheckpoint, match="data_state.json: .*replaced"):
        checked.read_bytes(tag / "data_state.json")
    checked.close()


def test_a_file_added_after_the_check_or_a_stream_is_never_loaded(key_file, tmp_path):  # noqa: F811
    tag = signed_tag(tmp_path)
    marker = tmp_path / "payload_ran"
    checked = CheckedCheckpoint.open(tag)
    torch.save({"x": Payload(marker)}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with checked.guard():
        with pytest.raises(ChangedCheckpoint, match="optim_states.pt: not part of the checkpoint as it was written"):
            torch.load(str(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"), weights_only=False)
        with pytest.raises(ChangedCheckpoint, match="stream"):
            with open(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rb") as fh:
                torch.load(fh, weights_only=False)
    assert not marker.exists() and torch.load is not None


def test_a_directory_renamed_into_place_after_the_open_changes_nothing(key_file, tmp_path):  # noqa: F811
    tag = signed_tag(tmp_path)
    checked = CheckedCheckpoint.open(tag)
    os.rename(tag, tmp_path / "aside")
    other = signed_tag(tmp_path)  # another signed checkpoint at the same path
    torch.save({"module": {"w": torch.ones(4)}}, other / STATES)  # (and then changed: its record no longer fits)
    with checked.guard():
        states = torch.load(str(tag / STATES), weights_only=False)
    assert torch.equal(states["module"]["w"], torch.arange(4.0))  # read through the directory that was checked


def test_another_record_or_an_unsigned_one_is_refused(key_file, tmp_path):  # noqa: F811
    tag = signed_tag(tmp_path)
    pinned = read_pinned(tag)
    record = json.loads((tag / "complete.json").read_text())
    (tag / "complete.json").write_text(json.dumps(trust.sign({**record, "saved_at": 1.0})))  # signed, but not it
    with pytest.raises(ChangedCheckpoint, match="changed since the launching process checked it"):
        CheckedCheckpoint.open(tag, pinned)
    record.pop("signature")
    (tag / "complete.json").write_text(json.dumps(record))
    with pytest.raises(ChangedCheckpoint, match="it is not signed"):
        CheckedCheckpoint.open(tag)


def test_a_trusted_unsigned_record_is_screened_on_the_descriptor(key_file, tmp_path):  # noqa: F811
    """--trust-checkpoint: the launching process pinned the unsigned record; a payload with matching hashes (the
    record's author's own) is still refused by the pickle screen, read from the same descriptor."""
    marker = tmp_path / "payload_ran"
    tag = signed_tag(tmp_path, sign=False)
    swap_in_payload(tag, marker)
    record = {"step": 4, "world_size": 1, "files": manifest.describe(tag, skip=["complete.json"])}
    (tag / "complete.json").write_text(json.dumps(record))
    checked = CheckedCheckpoint.open(tag, read_pinned(tag))
    with checked.guard(), pytest.raises(ChangedCheckpoint, match="its pickle imports posix.system"):
        torch.load(str(tag / STATES), weights_only=False)
    assert not marker.exists()
