"""Content keys: what makes prepared data (and a run's data fingerprint) change.

A key hashes the input files' contents (an object in a store: its ETag/version, `remote.identity`), the dataset/template config, the tokenization settings, the seed and the
tokenizer itself. File hashes are memoised by path, size, inode, modification and change time: a same-size edit with
its modification time set back still changes the change time, which no user call can set back. A file changed
within RACY_SECONDS of being hashed could share its change time with that edit (timestamps are coarse), so, as git
does with "racily clean" entries, such a file's hash is not memoised.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from dsrecipes import __version__
from dsrecipes.core.fileio import atomic_write_json, read_json_file
from dsrecipes.core.paths import user_cache_dir
from dsrecipes.core.schema import RowKind, SourceConfig, TrainConfig, TrainOn
from dsrecipes.core.typed import config_to_dict
from dsrecipes.data.rowkinds import ROW_KINDS
from dsrecipes.data.sources.files import expand_paths
from dsrecipes.data.sources.remote import identity as remote_identity
from dsrecipes.data.sources.remote import is_url

RACY_SECONDS = 2.0  # a file changed this recently is hashed, not memoised
PREP_VERSION = 5  # bump when the output of preparation changes for the same inputs (2: one-text tokenization,
# 3: caches carry a content record, cache_contents.py; older ones have none and are not reused; 4: OpenAI rows'
# `"weight": 0` messages are context, not labels; 5: prompt rows read TRL's `solution` column as their reference)
HISTORY_CUT = 1  # in the key of SFT data under data.train_on=last_assistant alone (the only preparations it changes):
# a row that would lose its last reply to the cutoff drops earlier turns instead of being dropped
# (data/render/history_cut.py); a cache prepared before (no such entry) dropped those rows
MEMO_FILE = "file_hashes.json"


# Keys added to a hashed section after runs existed, with the value(s) those runs read their data as: there they are
# left out of the material, so an upgrade keeps the identity (cache key, data fingerprint, scan key) of the data an
# older run was prepared on and its resume goes on (run/legacy_keys.py has the resume side); another value changes
# it. A source's pairs_as is stamped with the dataset's (registry.resolve_sources), so `refuse` there too.
AS_BEFORE = {"dataset": {"pairs_as": ("refuse",)}, "source": {"pairs_as": (None, "refuse")}}


def as_before(section: str, value: Any) -> Dict[str, Any]:
    """`config_to_dict(value)` for a key's material: without the keys of AS_BEFORE[section] at an older run's value
    (a dataset's `sources` entries too)."""
    data = config_to_dict(value)
    out = {k: v for k, v in data.items() if v not in AS_BEFORE[section].get(k, ())}
    if section == "dataset" and isinstance(out.get("sources"), list):
        out["sources"] = [{k: v for k, v in s.items() if v not in AS_BEFORE["source"].get(k, ())}
                          if isinstance(s, dict) else s for s in out["sources"]]
    return out


def cache_root(cfg: TrainConfig) -> Path:
    if cfg.data.cache_dir:
        return Path(os.path.expanduser(cfg.data.cache_dir))
    return user_cache_dir() / "dsrecipes"


def sources_material(cfg: TrainConfig, sources: Sequence[SourceConfig],
                     known: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    """Every source with the content hash of each of its files (the data part of every key). `known`: hashes this
    launch already computed while reading the files (the stream index), so they are not read again."""
    known = known or {}

    memo_path = cache_root(cfg) / MEMO_FILE
    memo = _read_memo(memo_path)
    material = []
    for src in sources:
        files, missing = expand_paths(src.paths)
        # the whole source: a registry entry's weight, columns, roles and caps live in the registry file, not in
        # cfg.dataset, so an edited entry must change the key as an edited dataset.sources does
        material.append({"name": src.name, "files": [[f, known.get(f) or file_hash(f, memo)] for f in files],
                         "missing": missing, "source": as_before("source", src)})
    _write_memo(memo_path, memo)
    return material


def data_fingerprint(cfg: TrainConfig, sources: Sequence[SourceConfig], known: Optional[Dict[str, str]] = None) -> str:
    """The training data's identity for streams (no preparation): dataset config and file contents (`known`: see
    `sources_material`)."""
    material = {"dataset": as_before("dataset", cfg.dataset), "sources": sources_material(cfg, sources, known)}
    return _digest(material)


def cache_key(cfg: TrainConfig, tokenizer: Any, sources: Sequence[SourceConfig]) -> str:
    """The key of prepared data: a different key means a different preparation."""
    material = {
        "version": PREP_VERSION,
        "dataset": as_before("dataset", cfg.dataset),
        "sources": sources_material(cfg, sources),
        "template": config_to_dict(cfg.template),
        "data": {k: config_to_dict(getattr(cfg.data, k)) for k in ("cutoff_len", "packing", "train_on")},
        "seed": cfg.trainer.seed,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "rows": cfg.objective.rows.value,  # conversations or preference pairs (the objective's row kind)
    }
    material.update(ROW_KINDS[cfg.objective.rows].check_settings(cfg))  # a prompt's budget: max_completion_length
    if cfg.objective.rows is RowKind.conversation and cfg.data.train_on is TrainOn.last_assistant:
        material["history_cut"] = HISTORY_CUT
    return _digest(material)


def _digest(material: Any) -> str:
    return hashlib.blake2b(json.dumps(material, sort_keys=True).encode(), digest_size=12).hexdigest()


def preparation_record(tokenizer: Any) -> Dict[str, Any]:
    """What makes a key besides the files and settings, kept in the run plan beside the data fingerprint, so that a
    refused resume can say which of them changed (run/data_change.py): this dsrecipes's preparation version and
    release, and the tokenizer's fingerprint (None where the strategy's key does not hash a tokenizer)."""
    return {"prep_version": PREP_VERSION, "dsrecipes": __version__,
            "tokenizer": None if tokenizer is None else tokenizer_fingerprint(tokenizer)}


def tokenizer_fingerprint(tokenizer: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(tokenizer.backend_tokenizer.to_str().encode())
    extra = [type(tokenizer).__name__, getattr(tokenizer, "chat_template", None), tokenizer.bos_token,
             tokenizer.eos_token, tokenizer.pad_token]
    h.update(json.dumps(extra, default=str).encode())
    return h.hexdigest()


def file_hash(path: str, memo: Dict[str, str], on_block: Optional[Callable[[bytes], None]] = None) -> str:
    """Content hash of `path`, memoised; `on_block` sees every block when the file is actually read (so a caller can
    index a file in the same pass that hashes it)."""
    if is_url(path):  # an object's ETag/version is its identity: its content is not read for a key
        return remote_identity(path)
    st = os.stat(path)
    memo_key = _stat_key(path, st)
    if memo_key in memo:
        return memo[memo_key]
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
            if on_block is not None:
                on_block(block)
    digest = h.hexdigest()
    after = os.stat(path)
    if _stat_key(path, after) == memo_key and time.time() - max(after.st_ctime, after.st_mtime) > RACY_SECONDS:
        memo[memo_key] = digest
    return digest


def _stat_key(path: str, st: os.stat_result) -> str:
    return f"{os.path.abspath(path)}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def content_hashes(cfg: TrainConfig, paths: Sequence[str],
                   on_block: Optional[Callable[[str], Optional[Callable[[bytes], None]]]] = None) -> List[str]:
    """Memoised content hashes of `paths` (the keys `sources_material` uses); `on_block(path)` may give a block
    callback per file (see `file_hash`)."""
    memo_path = cache_root(cfg) / MEMO_FILE
    memo = _read_memo(memo_path)
    out = [file_hash(p, memo, None if on_block is None else on_block(p)) for p in paths]
    _write_memo(memo_path, memo)
    return out


def _read_memo(path: Path) -> Dict[str, str]:
    """The memo of content hashes; {} (every file hashed again, the memo rewritten) when it is missing or not ours to
    read: not JSON, not an object, a FIFO (never waited on), over fileio's bound or nested too deeply."""
    try:
        memo = read_json_file(path, "JSON nested too deeply to be a memo of hashes")
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _write_memo(path: Path, memo: Dict[str, str]) -> None:
    try:
        atomic_write_json(path, memo)
    except OSError:
        pass  # a read-only cache root only costs re-hashing next time


def data_files(cfg: TrainConfig, sources: Sequence[SourceConfig], known: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """{file: content hash} of every training file (a resume names the files that changed); `known`: see
    `sources_material`."""
    return {path: digest for src in sources_material(cfg, sources, known) for path, digest in src["files"]}
