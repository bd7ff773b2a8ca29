"""Writing and opening files: the one atomic-write helper every file the project writes goes through, and the one
bounded JSON reader (`read_json_file`, `loads_bounded`) for every JSON file someone else may have written.

A reader (another rank, another node, a resumed run, a user's editor) never sees half a file: text is written to a
uniquely named temporary file beside the target, flushed and fsynced, then renamed into place. JSON is strict
(no NaN/Infinity, which other tools cannot parse): non-finite floats are written as null.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically (write beside, fsync, rename); creates the parent directory."""
    with atomic_writer(path) as fh:
        fh.write(text.encode("utf-8"))
    return Path(path)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically (see `atomic_writer`)."""
    with atomic_writer(path) as fh:
        fh.write(data)
    return Path(path)


@contextmanager
def atomic_writer(path: str | Path) -> Iterator[IO[bytes]]:
    """A binary file that appears at `path` only complete: written beside, fsynced and renamed when the block ends
    without an exception (removed otherwise). For large streamed outputs (converted data, indexes) too."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A new file of ours, never one already there: the name is not guessable and O_EXCL|O_NOFOLLOW refuses anything
    # at it, so a link planted beside `path` (a shared /tmp) cannot make this write into another file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def missing_dirs(path: str | Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, deepest first: what making `path` creates (and what to take
    back, while empty, after a failure)."""
    path = Path(path)
    return [p for p in [path, *path.parents] if not os.path.lexists(p)]


def read_regular_bytes(path: str | Path, limit: int | None = None) -> bytes:
    """The bytes of `path` when it is a regular file: ValueError for a FIFO, a device or a socket (a FIFO planted where
    a marker or record belongs would block its reader for ever, a device would never end), or for a file of more than
    `limit` bytes (never read into memory); OSError when unreadable."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens at once without a writer
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        if limit is None:
            return fh.read()
        data = fh.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"larger than {limit} bytes")
        return data


MAX_JSON_BYTES = 64 << 20  # a settings file or a commit record is kilobytes, a tokenizer_config.json megabytes at most


class Unreadable(ValueError):
    """JSON that no parser should be handed: not a regular file, over its size bound, or nested too deeply for
    Python's parser. Its text is the reason only; the caller's message names the file (and line)."""


def loads_bounded(text: str | bytes, too_deep: str) -> Any:
    """`json.loads` of `text` (bytes are decoded as UTF-8 first): Unreadable(`too_deep`) for JSON nested too deeply
    for Python's parser (json's RecursionError: 100000 '[' were a traceback); ValueError (UnicodeDecodeError,
    JSONDecodeError) when it is not UTF-8 JSON."""
    try:
        return json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except RecursionError:
        raise Unreadable(too_deep) from None


def read_json_file(path: str | Path, too_deep: str, limit: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in `path`, read within bounds: Unreadable for a FIFO, device or socket (never waited on), a file
    over `limit` bytes (never read whole) or JSON nested too deeply (`too_deep` is then its text); OSError when it
    cannot be opened; ValueError when it is not UTF-8 JSON."""
    try:
        data = read_regular_bytes(path, limit=limit)
    except ValueError as exc:  # "not a regular file", "larger than N bytes"
        raise Unreadable(str(exc)) from None
    return loads_bounded(data, too_deep)


def not_regular(path: str | Path) -> str | None:
    """What `path` is when something other than a regular file is there ("a FIFO", "a directory", ...), else None (a
    regular file, or nothing at all). Only stat: a FIFO is never opened."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "a symbolic link to nothing" if os.path.islink(path) else None
    except OSError:
        return None  # unreadable metadata: the caller's own open says why
    if stat.S_ISREG(mode):
        return None
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def dangling_link(path: str | Path) -> Path | None:
    """The first of `path` and its ancestors that is a symbolic link leading nowhere (its target missing, or a loop
    of links), else None. Making `path` would create the link's target, a place the user did not name."""
    path = Path(os.path.abspath(os.path.expanduser(path)))
    return next((p for p in [path, *path.parents] if os.path.islink(p) and not os.path.exists(p)), None)


def dangling_link_problem(key: str, path: str | Path) -> str:
    """`key: PATH is a symbolic link to X, which does not exist; ...` when `dangling_link(path)` finds one, else ''."""
    link = dangling_link(path)
    if link is None:
        return ""
    try:
        target = os.readlink(link)
    except OSError:
        target = "?"
    where = "is" if link == Path(os.path.abspath(os.path.expanduser(path))) else f"lies below {link}, which is"
    return (f"{key}: {path} {where} a symbolic link to {target}, which does not exist (a dangling link); dsrecipes "
            "does not create a link's target. Create the target, remove the link, or choose another path; nothing "
            "was changed")


def remove_empty_dirs(made: "list[Path] | tuple[Path, ...]") -> None:
    """Take back directories `missing_dirs` listed (deepest first) while they are empty: the first that holds
    anything (someone else's files) stays, and so do its parents."""
    for path in made:
        try:
            path.rmdir()
        except OSError:
            break


def open_append_fd(path: str | Path) -> int:
    """A write-only descriptor appending to `path` (created 0644 if missing, parent included). A symbolic link at
    `path` is refused (O_NOFOLLOW: OSError ELOOP), so a link planted in a run directory cannot make a run append to a
    file elsewhere (rundir.claim also refuses a run directory that holds links)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)


def open_append(path: str | Path, buffering: int = -1) -> IO[str]:
    """`open(path, "a", encoding="utf-8")` through `open_append_fd` (no symbolic link followed)."""
    return os.fdopen(open_append_fd(path), "a", encoding="utf-8", buffering=buffering)


def json_text(data: Any, indent: int | None = 2) -> str:
    """Strict JSON (non-finite floats become null), UTF-8 kept readable, with a final newline."""
    return json.dumps(finite(data), indent=indent, ensure_ascii=False, allow_nan=False, default=str) + "\n"


def atomic_write_json(path: str | Path, data: Any, indent: int | None = 2) -> Path:
    return atomic_write_text(path, json_text(data, indent))


def finite(value: Any) -> Any:
    """`value` with every NaN/Infinity float replaced by None (recursively through dicts, lists and tuples)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def open_maybe_gzip(path: str | Path) -> IO[bytes]:
    """A binary reader of `path`, decompressing `.gz` files."""
    return gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")
