"""Which sources a dataset config reads: `dataset.paths`, `dataset.sources`, and registry entries (`dataset.use`).

Two registry formats, chosen by file extension:

* `dataset_info.json` (LLaMA-Factory): `{"name": {"file_name": ..., "formatting": "sharegpt"|"alpaca",
  "columns": {...}, "tags": {...}, "num_samples": N}}`. `file_name` is relative to the registry's folder and may be
  a folder (every .json/.jsonl[.gz] in it). ShareGPT `tags` (role_tag, content_tag, user_tag, assistant_tag,
  observation_tag, function_tag, system_tag) become our columns and role aliases; alpaca `columns` prompt/query/
  response/system/history map to instruction/input/output/system/history. As in LLaMA-Factory, a row's system prompt,
  tools and alpaca history are read only from columns that `columns` names (NOT_READ otherwise). `num_samples` becomes `max_samples` (the
  first N rows; LLaMA-Factory would also up-sample, use `weight` here for that). `ranking: true` marks preference
  rows (`chosen`/`rejected` columns; objective=dpo reads them, objective=sft refuses them unless
  `dataset.pairs_as=chosen`). Hub, script and multimodal entries are rejected: we would otherwise silently train on
  something else.
* `*.yaml` / `*.yml`: `name: {paths: [...], format: ..., columns: {...}, roles: {...}, max_samples: N, weight: W}`,
  typed by `SourceConfig` (unknown keys are errors); relative paths are relative to the registry file.

Each file is read once by real path (`read_once`), and a `dataset.val_paths` file that is also a training file is
refused (`validation_files`), so no row is both trained and evaluated on. Two used dataset_info.json entries naming
one file are refused (`one_entry_per_file`: LLaMA-Factory would read it once per entry).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
from typing import Any, Dict, List, Optional, Tuple

import dsrecipes.core.bounded_yaml as bounded_yaml
from dsrecipes.core.errors import ConfigError, DataError
from dsrecipes.core.fileio import loads_bounded, read_regular_bytes
from dsrecipes.core.paths import SAMPLE_DATA_DIR
from dsrecipes.core.schema import ColumnsConfig, DatasetConfig, DatasetFormat, SourceConfig
from dsrecipes.core.suggest import closest, phrase
from dsrecipes.core.typed import convert
from dsrecipes.data.sources.files import expand_paths
from dsrecipes.data.sources.formats import other_format, other_format_message
from dsrecipes.data.sources.remote import looks_like_url
from dsrecipes.data.sources.split_shares import stamp

_LF_UNSUPPORTED = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
_LF_MEDIA_COLUMNS = ("images", "videos", "audios", "kto_tag")
_LF_ROLE_TAGS = {  # tag -> (LLaMA-Factory default value, our role)
    "user_tag": ("human", "user"),
    "assistant_tag": ("gpt", "assistant"),
    "observation_tag": ("observation", "observation"),
    "function_tag": ("function_call", "tool_call"),
    "system_tag": ("system", "system"),
}
# LLaMA-Factory reads an entry's system prompt, tools and alpaca history only from the columns its `columns` names
# (parser.DatasetAttr: system, tools, history default to None); a row's field of that name is otherwise not read.
# This column name is in no row, so it reads nothing.
NOT_READ = ""
_DATA_SUFFIXES = (".json", ".jsonl", ".json.gz", ".jsonl.gz", ".parquet", ".pq")  # Parquet: read by data=map
# Bytes read of a registry file at most: LLaMA-Factory's own dataset_info.json is about 30 KB. PyYAML's pure-Python
# parser reads about half a MiB a second (even of comments), so a YAML registry gets less room than JSON.
MAX_REGISTRY_BYTES = {"yaml": 2 << 20, "llamafactory": 16 << 20}


def resolve_sources(dataset_cfg: DatasetConfig, notes: Optional[List[str]] = None,
                    registry_digest: Optional[str] = None) -> List[SourceConfig]:
    """Every source to read, in a fixed order: `paths` (as a source named `dataset.name`; the bundled sample only
    when nothing else is named or `dataset.mix_sample` asks for it, see `sample_replaced`), `sources`, `use`; each
    file once (see `read_once`, whose notes are appended to `notes`). `registry_digest`: what the launching process
    read of `dataset.registry` (`registry_digest`), which a rank's read must find."""
    ds = dataset_cfg
    sources: List[SourceConfig] = []
    if ds.paths and not sample_replaced(ds):
        sources.append(SourceConfig(name=ds.name, paths=list(ds.paths), format=ds.format, columns=ds.columns,
                                    roles=dict(ds.roles)))
    for i, src in enumerate(ds.sources):  # copies: the typed config is never mutated
        check_share(f"dataset.sources[{i}]", src)
        sources.append(dataclasses.replace(src, name=src.name or f"source{i}", paths=list(src.paths)))
    if ds.use:
        if not ds.registry:
            raise ConfigError("dataset.registry: dataset.use names registry entries, so a registry file is needed")
        entries = load_registry(ds.registry, use=ds.use, digest=registry_digest)
        if not ds.registry.endswith((".yaml", ".yml")):
            one_entry_per_file(ds.registry, ds.use, entries)
        sources += [entries[name] for name in ds.use]
    seen: Dict[str, int] = {}
    for k, src in enumerate(sources):  # unique names: mixing weights are applied per source name
        seen[src.name] = seen.get(src.name, 0) + 1
        if seen[src.name] > 1:
            sources[k] = dataclasses.replace(src, name=f"{src.name}#{seen[src.name]}")
    sources = [s if s.pairs_as is not None else dataclasses.replace(s, pairs_as=ds.pairs_as) for s in sources]
    return stamp(ds.split, read_once(sources, notes))  # each source reads only the run's share (dataset.split)


def one_entry_per_file(registry: str, use: List[str], entries: Dict[str, SourceConfig]) -> None:
    """LLaMA-Factory reads a file once per entry its `dataset: a,b` names (two entries naming one file: its rows
    twice, each time with that entry's columns and num_samples); dsrecipes reads a file once (`read_once`), which
    would keep one entry and drop the other. So two used entries of a dataset_info.json naming the same file (the
    same entry named twice too) are refused, naming both and the file."""
    first: Dict[str, Tuple[int, str]] = {}  # real path (a URL as written) -> (position in `use`, entry)
    for i, name in enumerate(use):
        for path in entries[name].paths:
            real = path if looks_like_url(path) else os.path.realpath(path)
            j, other = first.setdefault(real, (i, name))
            if j == i:
                continue
            which = f"entry {name!r} is named twice" if other == name else f"entries {other!r} and {name!r} both name"
            raise ConfigError(
                f"dataset.use (LLaMA-Factory's `dataset:`): {which} {real} (in {registry}). "
                "LLaMA-Factory would read that file once per entry (its rows twice); dsrecipes reads a file once and "
                "would drop one of them. Name it once (a larger share of its rows: a mixing weight, "
                "dataset.sources[].weight); nothing was read")


def sample_replaced(ds: DatasetConfig) -> bool:
    """True when `dataset.paths` is still the bundled sample and the user named data (`dataset.use` or
    `dataset.sources`) without `dataset.mix_sample=true`: what they named replaces the sample rather than being
    silently mixed with its rows."""
    if ds.mix_sample or not (ds.use or ds.sources):
        return False
    sample = os.path.realpath(SAMPLE_DATA_DIR / "train.jsonl")
    return [os.path.realpath(p) for p in ds.paths] == [sample]


def read_once(sources: List[SourceConfig], notes: Optional[List[str]] = None) -> List[SourceConfig]:
    """Sources whose patterns are expanded to files, each file (by resolved real path) kept only where it is first
    named: the same file under two spellings (absolute, relative, `./`, `../`, a link) would otherwise be read twice
    and its rows could land in both the training and the validation split. Patterns matching nothing stay (the
    reader reports them); file names are glob-escaped so that a re-expansion finds exactly that file."""

    first: Dict[str, str] = {}  # real path -> the spelling that was kept (with its source)
    out = []
    for src in sources:
        files, missing = expand_paths(src.paths)
        kept = []
        for f in files:
            real = os.path.realpath(f)
            if real in first:
                if notes is not None:
                    notes.append(f"data: {f} (source {src.name!r}) is the same file as {first[real]}; it is read once")
                continue
            first[real] = f"{f} (source {src.name!r})"
            kept.append(glob.escape(f))
        out.append(dataclasses.replace(src, paths=kept + missing))
    return out


def validation_files(train: List[str], val: List[str], notes: List[str]) -> List[str]:
    """`dataset.val_paths`' files (`val`) each once by real path; one that is also a training file is refused
    whatever it is called (absolute, relative, `./`, `../`, a link): its rows would be evaluated after being
    trained on."""
    trained = {os.path.realpath(n): n for n in train}
    kept: Dict[str, str] = {}
    for name in val:
        real = os.path.realpath(name)
        if real in trained:
            raise DataError(f"dataset.val_paths: {name} is the same file as the training file {trained[real]}; "
                            "a validation file must not also be trained on (remove it from one of the two)")
        if real in kept:
            notes.append(f"data: {name} (dataset.val_paths) is the same file as {kept[real]}; it is read once")
            continue
        kept[real] = name
    return list(kept.values())


def load_registry(path: str, use: Optional[List[str]] = None, checked: bool = False,
                  digest: Optional[str] = None) -> Dict[str, SourceConfig]:
    """The entries of a registry file, typed; with `use`, only those (each must be there): LLaMA-Factory's own
    data/dataset_info.json holds hundreds of hub entries beside the local ones a run names, and only what is used
    has to be readable here. `checked`: this read is the one a composition's check judges (config/safety.py); every
    later read of the file in this process must find the same bytes, and so must a read given their `digest`
    (`read_registry_text`)."""
    typed, path = path, os.path.expanduser(path)
    base = os.path.dirname(os.path.abspath(path))
    kind = "yaml" if path.endswith((".yaml", ".yml")) else "llamafactory"
    limit = MAX_REGISTRY_BYTES[kind]
    try:
        text = read_registry_text(path, limit, checked, digest)
        # an alias bomb is refused before it is walked; JSON nested too deeply is refused, not a RecursionError
        data = bounded_yaml.safe_load(text) if kind == "yaml" else loads_bounded(text, "JSON nested too deeply")
    except ConfigError:
        raise
    except bounded_yaml.SelfReference as exc:
        raise ConfigError(f"dataset.registry: {path}:{exc}: an alias (*name) inside the value it names") from None
    except Exception as exc:  # OSError, ValueError (too large, not a file, not UTF-8, not JSON), YAMLError, TooLarge
        why = " ".join(str(exc).split())
        hint = f" (a registry names datasets: kilobytes; at most {limit >> 20} MiB is read)" if "larger than" in why \
            else ""
        raise ConfigError(f"dataset.registry: cannot read {path}: {why}{hint}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"dataset.registry: {path} must map entry names to entries")
    build = _yaml_entry if kind == "yaml" else _llamafactory_entry
    data = {str(name): entry for name, entry in data.items()}
    for name in use or ():
        if name not in data:
            names = sorted(data)
            listed = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
            raise ConfigError(f"dataset.use: {name!r} is not in {typed}{phrase(closest(name, names))} "
                              f"(entries: {listed})")
    return {name: build(name, data[name], base) for name in (data if use is None else use)}


# absolute path -> (sha256, checked). checked: the bytes the composition's check read (sha256 None: unreadable then),
# which every later read must find and which is what this process used; else the bytes last read, binding nothing.
_DIGESTS: Dict[str, Tuple[Optional[str], bool]] = {}


def read_registry_text(path: str, limit: int, checked: bool, digest: Optional[str] = None) -> str:
    """The text of the registry file `path`, read within `limit` bytes (a FIFO, a device or a larger file is refused
    unread: a 2 GB file or /dev/zero never ends). The composition's check (config/safety.py: the buckets a shared
    recipe's registry signs requests to) reads it with `checked`; every later read in this process (the data's
    identity, preparation, indexing: minutes later, after a model download) must find the bytes that were checked,
    and a rank's read the bytes the launching process used (`digest`, from the stream index), else ConfigError: a
    registry swapped in between (by whoever shares its folder, by a link's new target) would be used unchecked. By
    its absolute path as named, so a link pointed elsewhere is the same registry changed."""
    where = os.path.abspath(path)
    if checked:
        _DIGESTS[where] = (None, True)  # until it is read: a registry unreadable when checked is never used later
    if not os.path.isfile(path):
        raise ConfigError(f"dataset.registry: {path!r} does not exist")
    raw = read_regular_bytes(path, limit)
    found = hashlib.sha256(raw).hexdigest()
    if checked:
        _DIGESTS[where] = (found, True)
    pinned, was_checked = _DIGESTS.get(where, (None, False))
    expected = digest if digest is not None else pinned if was_checked else found
    if found != expected:
        when = "this command checked it (when it composed the config" if digest is None else \
            "the launching process read it (for this run's stream index"
        raise ConfigError(f"dataset.registry: {path} changed after {when}: which stores its entries read); a "
                          "registry is used only as it was checked. Run the command again, and find out what "
                          "rewrites that file")
    if not was_checked:
        _DIGESTS[where] = (found, False)
    return raw.decode("utf-8")


def registry_digest(path: Optional[str]) -> Optional[str]:
    """The sha256 of what this process used of the registry file `path`, for a rank to find: the bytes its check read
    (every later read found them), else the bytes last read; None: not read (or unreadable when checked)."""
    return _DIGESTS.get(os.path.abspath(os.path.expanduser(path)), (None, False))[0] if path else None


def _yaml_entry(name: str, entry: Any, base: str) -> SourceConfig:
    if not isinstance(entry, dict):
        raise ConfigError(f"dataset.registry.{name}: expected a mapping")
    errors: List[str] = []
    src = convert(SourceConfig, {"name": name, **entry}, f"dataset.registry.{name}", errors)
    if errors:
        raise ConfigError(errors)
    check_share(f"dataset.registry.{name}", src)
    src.paths = [p if looks_like_url(p) or os.path.isabs(os.path.expanduser(p)) else os.path.join(base, p)
                 for p in src.paths]
    return src


def check_share(where: str, src: SourceConfig) -> None:
    """A source's `max_samples` and `weight` leave it something to train on: 0 or less read nothing of it, silently
    (one such source alone prepared an empty training split)."""
    if src.max_samples is not None and src.max_samples < 1:
        raise ConfigError(f"{where}.max_samples: must be >= 1, got {src.max_samples} (leave it out to read every row)")
    if not src.weight > 0 or src.weight == float("inf"):
        raise ConfigError(f"{where}.weight: must be a finite number > 0, got {src.weight}")


def _llamafactory_entry(name: str, entry: Any, base: str) -> SourceConfig:
    where = f"dataset.registry.{name}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: expected a mapping")
    remote = [k for k in _LF_UNSUPPORTED if entry.get(k)]
    if remote or not entry.get("file_name"):
        hub = f": its files are read as dataset.paths=[hf://datasets/{entry['hf_hub_url']}/FILE]" \
            if remote and remote[0] == "hf_hub_url" else ""
        raise ConfigError(f"{where}: only local `file_name` entries are supported" +
                          (f" (has {remote[0]}{hub})" if remote else ""))
    columns, tags = _names(where, "columns", entry.get("columns")), _names(where, "tags", entry.get("tags"))
    media = [c for c in _LF_MEDIA_COLUMNS if c in columns]
    media += [c for c in ("chosen", "rejected") if c in columns and not entry.get("ranking")]
    if media:
        raise ConfigError(f"{where}: column {media[0]!r} is not supported (text-only SFT)")
    formatting = entry.get("formatting", "alpaca")  # LLaMA-Factory's default
    if formatting == "sharegpt":
        cols = ColumnsConfig(
            messages=columns.get("messages", "conversations"),
            role=tags.get("role_tag", "from"),
            content=tags.get("content_tag", "value"),
            system=columns.get("system", NOT_READ),
            tools=columns.get("tools", NOT_READ),
            chosen=columns.get("chosen", "chosen"),
            rejected=columns.get("rejected", "rejected"),
        )
        roles = _lf_roles(where, tags)
        fmt = DatasetFormat.sharegpt
    elif formatting == "alpaca":
        cols = ColumnsConfig(
            instruction=columns.get("prompt", "instruction"),
            input=columns.get("query", "input"),
            output=columns.get("response", "output"),
            system=columns.get("system", NOT_READ),
            tools=columns.get("tools", NOT_READ),
            history=columns.get("history", NOT_READ),
        )
        roles, fmt = {}, DatasetFormat.alpaca
    else:
        raise ConfigError(f"{where}: formatting {formatting!r} is not supported (sharegpt or alpaca)")
    file_name = str(entry["file_name"])
    target = file_name if looks_like_url(file_name) else os.path.join(base, os.path.expanduser(file_name))
    if os.path.isdir(target):
        paths = sorted(os.path.join(target, f) for f in os.listdir(target) if f.endswith(_DATA_SUFFIXES))
        if not paths:
            raise ConfigError(f"{where}: folder {target} holds no .json/.jsonl/.parquet files{_other_files(target)}")
    else:
        paths = [target]
    num, ranking = entry.get("num_samples"), entry.get("ranking") or False  # null as LLaMA-Factory's default
    if num is not None and (type(num) is not int or num < 1):
        raise ConfigError(f"{where}.num_samples: must be a whole number >= 1, got {num!r}")
    if not isinstance(ranking, bool):
        raise ConfigError(f"{where}.ranking: must be true or false, got {ranking!r}")
    if ranking and fmt is not DatasetFormat.sharegpt:
        raise ConfigError(f"{where}: preference (ranking) entries are read in the sharegpt formatting only")
    return SourceConfig(name=name, paths=paths, format=fmt, columns=cols, roles=roles, max_samples=num,
                        ranking=ranking)


def _other_files(folder: str) -> str:
    """For a folder of a LLaMA-Factory entry without data files: the files of another format in it (Parquet, CSV,
    ...: formats.other_format) and how to convert the first, else ""."""
    others = [(p, other_format(p)) for p in (os.path.join(folder, f) for f in sorted(os.listdir(folder)))
              if os.path.isfile(p) and other_format(p)]
    if not others:
        return ""
    path, kind = others[0]
    return f"; it holds {len(others)} file(s) of another format, first {other_format_message(path, kind)}"


def _names(where: str, key: str, value: Any) -> Dict[str, str]:
    """An entry's `columns` or `tags`: a mapping of names to the row's key or role names (strings), else refused."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}.{key}: expected a mapping of names to strings, got {type(value).__name__}")
    for k, v in value.items():
        if not isinstance(v, str) or not v:
            raise ConfigError(f"{where}.{key}.{k}: expected a non-empty string, got {v!r}")
    return value


def _lf_roles(where: str, tags: Dict[str, str]) -> Dict[str, str]:
    """Role value in the rows -> our role; two tags with the same value are refused (which role would the turn be?)."""
    roles: Dict[str, str] = {}
    tag_of: Dict[str, str] = {}
    for tag, (default, ours) in _LF_ROLE_TAGS.items():
        value = tags.get(tag, default)
        if value in tag_of:
            raise ConfigError(f"{where}.tags: {tag_of[value]} and {tag} are both {value!r}; a turn with that role "
                              "would be read as one of them silently: give each role its own value")
        roles[value], tag_of[value] = ours, tag
    return roles
