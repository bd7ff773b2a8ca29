"""Why a checkpoint's training data fingerprint differs from this run's, in words the user can act on.

The fingerprint (data/prepare/cache.py) hashes the training files, the data settings and, for prepared data, the
tokenizer and dsrecipes's own preparation version. A refused resume used to blame "file contents or preparation
settings" whatever changed, which sends a user who only upgraded dsrecipes to look at their files. The run plan
records what prepared the data besides files and settings (`cache.preparation_record`); with it the message names
the one that changed. A checkpoint whose run plan has no such record (written before it was kept) gets both
possibilities that remain once files and settings are known to be unchanged. Files of unknown hash (presharded parts)
or changed settings leave the old words: nothing more is known.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

UNKNOWN = "file contents or preparation settings"
NEW_RUN = "start a new run in another trainer.output_dir"


@dataclass
class DataChange:
    """What is known about the checkpoint's data and this run's: {file: content hash} of the training files, and
    the preparation records (None: the checkpoint's run plan has none, or it is not the plan that wrote it)."""

    saved_files: Dict[str, str] = field(default_factory=dict)
    files: Dict[str, str] = field(default_factory=dict)
    saved_prep: Optional[Dict[str, Any]] = None
    prep: Dict[str, Any] = field(default_factory=dict)
    val_files: bool = False  # dataset.val_paths: their contents are in a prepared key but not in `files`
    registry: bool = False  # dataset.use: the registry's entries are in every key but not in the config

    def others(self) -> List[str]:
        """What else a key holds that neither `files` nor the settings show."""
        return ((["a dataset.val_paths file changed"] if self.val_files else []) +
                (["an entry of dataset.registry changed"] if self.registry else []))

    def changed_files(self) -> List[str]:
        saved, now = self.saved_files, self.files
        changed = [f"{f} changed" for f in sorted(set(saved) & set(now)) if saved[f] != now[f]]
        changed += [f"{f} is new" for f in sorted(set(now) - set(saved)) if saved]
        return changed + [f"{f} is gone" for f in sorted(set(saved) - set(now))]


def explain(data: DataChange, settings_differ: bool) -> Tuple[str, Optional[str]]:
    """(what changed, the remedy when it is not restoring settings: None) for a differing data fingerprint."""
    changed = data.changed_files()
    if changed:
        return "; ".join(changed), None
    if settings_differ or not data.saved_files:
        return UNKNOWN, None  # the settings listed beside it, or files whose hashes were not recorded
    old, now = data.saved_prep, data.prep
    if old is None:
        return _unrecorded(data)
    if old.get("prep_version") != now.get("prep_version"):
        return _version(old, now)
    if old.get("tokenizer") and now.get("tokenizer") and old["tokenizer"] != now["tokenizer"]:
        return ("the training files and settings are unchanged, but the tokenizer is not the one the checkpoint "
                "was prepared with: model.path (or model.tokenizer_path) now holds another vocabulary, special "
                "tokens or chat template (the same path, other files: e.g. a newer hub snapshot)",
                f"restore those tokenizer files to resume, or {NEW_RUN}")
    if old.get("dsrecipes") != now.get("dsrecipes"):
        causes = [f"dsrecipes {now.get('dsrecipes')} keys its preparation differently from dsrecipes "
                  f"{old.get('dsrecipes')}, which prepared this data", *data.others()]
        return (f"the training files and settings are unchanged, so: {' or '.join(causes)}",
                f"{NEW_RUN}, or install dsrecipes=={old.get('dsrecipes')} to finish this one")
    return UNKNOWN, None


def rendering_changed(data: Optional[DataChange]) -> Optional[Tuple[str, str]]:
    """(what changed, remedy) when the data fingerprint is the same but the recorded preparation version is not:
    `data=iterable` and `presharded` render and tokenize while training, so their fingerprint hashes no version, yet
    a resumed run would train on tokens rendered by other code (e.g. version 4 made weight-0 messages context).
    None when nothing was recorded (a run of before the record: nothing is known) or the versions agree."""
    if data is None or not data.saved_prep or data.saved_prep.get("prep_version") == data.prep.get("prep_version"):
        return None
    return _version(data.saved_prep, data.prep, "its samples were rendered and tokenized")


def _version(old: Dict[str, Any], now: Dict[str, Any], done: str = "the data was prepared") -> Tuple[str, str]:
    age = "an earlier" if (old.get("prep_version") or 0) < (now.get("prep_version") or 0) else "another"
    what = (f"the training files and settings are unchanged, but {done} by {age} dsrecipes "
            f"(preparation version {old.get('prep_version')}, now {now.get('prep_version')}); resuming would train "
            "on differently prepared tokens")
    if old.get("dsrecipes") and old.get("dsrecipes") != now.get("dsrecipes"):
        return what, f"{NEW_RUN}, or install dsrecipes=={old['dsrecipes']} to finish this one"
    return what, (f"{NEW_RUN}, or finish this one with the dsrecipes release that prepares data as version "
                  f"{old.get('prep_version')}")


def _unrecorded(data: DataChange) -> Tuple[str, str]:
    causes = [f"an earlier dsrecipes prepared it (this checkpoint's run does not record its preparation version; "
              f"this dsrecipes prepares version {data.prep.get('prep_version')})"]
    if data.prep.get("tokenizer"):
        causes.append("the tokenizer at model.path (or model.tokenizer_path) changed: the same path with another "
                      "vocabulary, special tokens or chat template")
    causes += data.others()
    return (f"the training files and settings are unchanged, so the difference is elsewhere: {' or '.join(causes)}",
            f"{NEW_RUN}, or resume with what prepared this checkpoint's data")
