"""Who wrote a checkpoint or an export: commit records signed with this user's key, checked before any load.

A checkpoint's files are pickles (DeepSpeed's engine and zero_to_fp32 read them with `weights_only=False`), so a
file list with hashes proves nothing by itself: whoever can write the files can write their hashes. The commit
record (checkpoints: complete.json; exports: dsrecipes_export.json) therefore carries an HMAC-SHA256 over its
canonical JSON, made with a per-user key that lives outside every run directory:

    $DSRECIPES_KEY_FILE, else $XDG_CONFIG_HOME/dsrecipes/checkpoint.key, else ~/.config/dsrecipes/checkpoint.key

created once (32 random bytes, hex, mode 0600, its directory 0700) the first time something is signed. A key that
others can read, or that another user owns, is refused: it would let them sign.

`check` is the one gate (export, resume, trainer.resume_from, prompt-eval and chat on run directories): the record
must read and carry this key's signature, else `Untrusted` (exit 2) saying how to trust it explicitly. Trusting is
a command-line decision of this invocation only (`--trust-checkpoint PATH`, `trust()`), never a config key: it
accepts the record as it is for this command and re-signs nothing (a run that continues from it signs only the
checkpoints it writes itself). Training checks in the launching process, which names the checkpoint in plan.json
for the ranks, so the decision never travels through the config; an export it accepted (a reward model) is pinned
there too (plan.json's exports): a rank loads one only when this user signed it or its record is the pinned one
(`launched`). A command printed to repeat a run repeats the flag where it loads again what the flag covered
(`repeat_flags`). The file hashes are verified in every case (checkpoint_find.damage), and the pickles of a checkpoint trusted that way are screened for what they
would import (safe_load.screen) before anything unpickles them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from dsrecipes.core.errors import Refused, UserError
from dsrecipes.core.export_dir import EXPORT_INFO
from dsrecipes.core.fileio import json_text
from dsrecipes.core.manifest import unlisted, verify
from dsrecipes.core.tokenizer import read_json

KEY_ENV = "DSRECIPES_KEY_FILE"
SIGNATURE = "signature"
SCHEME = "hmac-sha256"
FLAG = "--trust-checkpoint"
TRUST_HELP = ("load the checkpoint or export at PATH (or any below that directory) although this user's key did not "
              "sign it: for this command only; its file hashes are still checked and nothing is re-signed")

DEFAULT_COMMAND = "dsrecipes train ..."


@dataclass
class Invocation:
    """Every trust decision of one invocation (one command line: cli.main; one stage of a pipeline), in one place.
    `reset` replaces the whole object, so nothing of a previous invocation in the same process is left behind; no
    other state is kept by this module."""

    trusted: List[Path] = field(default_factory=list)  # its command line's --trust-checkpoint PATHs, resolved
    relied: List[Tuple[str, Path]] = field(default_factory=list)  # (what, where) accepted only because `trusted`
    exports: Dict[str, str] = field(default_factory=dict)  # export directory -> record_pin it accepted (check_export)
    launch: List[Dict[str, str]] = field(default_factory=list)  # on a rank, per `launched` block: accepted exports
    command: str = DEFAULT_COMMAND  # what a refusal of a run's inputs names to repeat with the flag (`trust`)

    def covers(self, where: Path) -> bool:
        """`where` (resolved) is at or below a trusted PATH."""
        return any(where == t or t in where.parents for t in self.trusted)

    def pins(self) -> Optional[Dict[str, str]]:
        """Inside `launched` (a rank): the exports its launching process accepted (innermost block); None outside."""
        return self.launch[-1] if self.launch else None


_now = Invocation()  # this invocation's; replaced whole by `reset`


class Untrusted(Refused):
    """A record that is unsigned, signed with another key, or altered: refused before anything is loaded."""


def key_path() -> Path:
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV]).expanduser()
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "dsrecipes" / "checkpoint.key"


def _publish_new_key(path: Path) -> None:
    """Write a new key beside `path` and link it into place: a process that finds `path` always finds a whole key
    (two runs starting at once never read a half-written one); FileExistsError when another process won."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(secrets.token_hex(32) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, path)
    finally:
        os.unlink(tmp)


def _place_problem(path: Path) -> Optional[str]:
    """Why the key at `path` cannot be trusted where it is: a symlink (whoever controls its target signs), or a
    directory others may write (they could replace the key with their own). None: it can."""
    if path.is_symlink():
        return "is a symlink; the checkpoint signing key must be a regular file at that path, not a link"
    try:
        info = path.parent.stat()
    except OSError:
        return None  # no directory yet: made 0700 with the key
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or info.st_uid not in (os.geteuid(), 0):
        return (f"is in {path.parent}, a directory others can write ({stat.filemode(info.st_mode)}, uid "
                f"{info.st_uid}): they could replace the key with theirs")
    return None


def _load_key(create: bool) -> Optional[bytes]:
    path = key_path()
    problem = _place_problem(path)
    if problem:
        raise UserError(f"{path}: the checkpoint signing key {problem}. Point {KEY_ENV} at a file in a private "
                        "directory of yours (mode 0700)")
    if not path.exists():
        if not create:
            return None
        try:
            _publish_new_key(path)
        except FileExistsError:  # another process made it meanwhile: use theirs
            if not path.is_file():
                raise UserError(f"{path}: cannot create the checkpoint signing key (a path below a file); point "
                                f"{KEY_ENV} at a file in a private directory you can write")
            return _load_key(False)
        except OSError as exc:
            raise UserError(f"{path}: cannot create the checkpoint signing key ({exc.strerror or exc}); point "
                            f"{KEY_ENV} at a file in a private directory you can write")
    try:  # O_NOFOLLOW: a link put in place after the check above is refused too
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise UserError(f"{path}: cannot read the checkpoint signing key ({exc.strerror or exc}); it must be a "
                        f"regular file of yours, not a link. Point {KEY_ENV} at a file in a private directory")
    with os.fdopen(fd, "rb") as fh:
        info, data = os.fstat(fh.fileno()), fh.read(4096)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(f"{path}: the checkpoint signing key must belong to you with mode 0600 (it is "
                        f"{stat.filemode(info.st_mode)}, uid {info.st_uid}); others could sign checkpoints with it. "
                        f"Fix it with `chmod 600 {path}`, or delete it to start a new key (your existing checkpoints "
                        f"then need {FLAG})")
    key = data.decode("ascii", "replace").strip()
    if len(key) < 32 or not key.isascii() or not key.isalnum():
        raise UserError(f"{path}: not a dsrecipes signing key (delete it to create a new one)")
    return key.encode("ascii")


def _digest(record: Dict[str, Any], key: bytes) -> str:
    body = {k: v for k, v in record.items() if k != SIGNATURE}
    payload = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return f"{SCHEME}:" + hmac.new(key, payload.encode("utf-8"), hashlib.sha256).hexdigest()


def ensure_key() -> None:
    """The signing key exists (made now if not): the launching process checks this before any rank starts, so a
    run does not fail at its first checkpoint for want of it."""
    _load_key(create=True)


def sign(record: Dict[str, Any]) -> Dict[str, Any]:
    """`record` as it will read back from its JSON file (fileio.json_text), with this user's signature (the key
    is created on first use)."""

    canonical = json.loads(json_text({k: v for k, v in record.items() if k != SIGNATURE}))
    return {**canonical, SIGNATURE: _digest(canonical, _load_key(create=True))}


def signature_problem(record: Dict[str, Any]) -> Optional[str]:
    """None when `record` carries this user's signature, else why not."""
    given = record.get(SIGNATURE)
    if not isinstance(given, str):
        return "it is not signed (written by another user, or by dsrecipes before checkpoints were signed)"
    key = _load_key(create=False)
    if key is None:
        return f"it is signed, but this user has no signing key ({key_path()}), so it was not written here"
    try:
        digest = _digest(record, key)
    except (TypeError, ValueError):  # 1e999 reads back as infinity, which no record dsrecipes writes holds
        return "it holds a number JSON cannot carry (infinity or NaN), so dsrecipes did not write it"
    if not hmac.compare_digest(given, digest):
        return "its signature does not match this user's key (written by another user or altered)"
    return None


def trust(paths: List[str], command: str = DEFAULT_COMMAND) -> None:
    """Accept the records at or below `paths` for this invocation (the command line's --trust-checkpoint). An empty
    PATH (`--trust-checkpoint=$UNSET`) is refused: it would resolve to the working directory and trust all below it;
    so is one that does not exist. `command`: this invocation, as a refusal of what a run would load (a reward model
    export: `run_command`) names it to repeat with the flag."""
    _now.command = command
    if any(not str(p).strip() for p in paths):
        raise UserError(f"{FLAG}: an empty PATH would trust everything below the working directory; name the "
                        f"checkpoint or run directory to trust: {FLAG} PATH")
    for path in paths:  # a mistyped PATH would trust nothing, in silence
        if not Path(path).expanduser().exists():
            raise UserError(f"argument {FLAG}: must be an existing path, got {path!r}")
    _now.trusted.extend(Path(p).expanduser().resolve() for p in paths)


def run_command() -> str:
    """The command to repeat with the flag when a run's input (a reward model export) is refused: `dsrecipes train
    ...`, or the command that checked it (`dsrecipes validate ...`)."""
    return _now.command


def take_flag(argv: List[str]) -> List[str]:
    """`argv` without its `--trust-checkpoint PATH` / `--trust-checkpoint=PATH` arguments, which are trusted
    (training: Hydra's parser owns the rest of the command line)."""
    rest, paths, it = [], [], iter(argv)
    for arg in it:
        if arg == FLAG:
            path = next(it, None)
            if path is None or path.startswith("-") or "=" in path:
                raise UserError(f"{FLAG} needs the checkpoint (or run directory) to trust: {FLAG} PATH")
            paths.append(path)
        elif arg.startswith(FLAG + "="):
            paths.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
    trust(paths)
    return rest


def reset() -> None:
    """A new invocation: nothing a previous one trusted, relied on, accepted, pinned or named is kept."""
    global _now
    _now = Invocation()


def repeat_flags(again: Callable[[str, Path], bool]) -> List[str]:
    """`--trust-checkpoint PATH` for each PATH of this command line (absolute) that accepted a record which a
    printed command repeating this one loads again (`again(what, where)`: "export" or "checkpoint", its directory):
    the resume command of a run that relied on them (checkpoint_find.trust_to_repeat); nothing when none did."""
    roots: List[Path] = []
    for what, where in _now.relied:
        if again(what, where):
            roots += [t for t in _now.trusted if (where == t or t in where.parents) and t not in roots]
    return [arg for root in roots for arg in (FLAG, str(root))]


def is_trusted(path: Path) -> bool:
    return _now.covers(Path(path).expanduser().resolve())


def check(record: Dict[str, Any], where: Path, what: str, retry: str) -> bool:
    """The one gate before any load from `where` (a checkpoint or an export, whose commit record is `record`):
    True when it carries this user's signature, False when it does not but the command line trusted `where`,
    else Untrusted (exit 2). `retry`: the command to repeat with the flag, for the message."""
    problem = signature_problem(record)
    if problem is None:
        return True
    if is_trusted(where):
        _now.relied.append((what, Path(where).expanduser().resolve()))
        return False
    raise Untrusted(
        f"{where}: refusing to load this {what}: {problem}. Its files are pickles, and loading them can run code, "
        f"so only files written by this user's runs load without asking. If you trust whoever wrote it, repeat "
        f"with `{retry} {FLAG} {where}`: that accepts it for that one command (its file "
        "hashes are still checked and a pickle that imports code is still refused); it is not re-signed")


def record_pin(record: Dict[str, Any]) -> str:
    """What the launching process pins of an export's record for the ranks (plan.json: exports)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=True).encode("utf-8")).hexdigest()


def accepted_exports() -> Dict[str, str]:
    """{export directory: record_pin} of every export this process accepted (signed, or trusted on its command
    line), for plan.json: a rank loads one only with the same record (`launched`)."""
    return dict(_now.exports)


@contextmanager
def launched(exports: Dict[str, str]) -> Iterator[None]:
    """A rank, inside this block: an export is accepted when signed by this user or when its record is the one the
    launching process accepted (`exports`: plan.json's), never by a command line (a rank has none; one that runs in
    the launching process checks again all the same, at the point of use)."""
    state = _now  # the block ends its own pins, even where a `reset` inside it began another invocation
    state.launch.append(dict(exports))
    try:
        yield
    finally:
        state.launch.pop()


def check_export(model_dir: Path, retry: str) -> None:
    """Before anything of `model_dir` is read: a dsrecipes export (it has EXPORT_INFO) must be signed by this user
    or trusted on the command line (`check`), and hold its files as written (every time); UserError else. Nothing
    for another directory. On a rank (`launched`), the record must carry this user's signature or be the one its
    launching process accepted, and a directory that was an export there must still be one: a record put in its
    place after the launching process checked it is refused where it would load."""
    pins = _now.pins()
    marker, where = model_dir / EXPORT_INFO, str(Path(model_dir).expanduser().resolve())
    if not marker.exists():
        if pins is not None and where in pins:
            raise Untrusted(f"{marker}: missing, but the launching process checked this export with it (the "
                            "directory was replaced since); nothing was loaded")
        return
    try:
        record = read_json(marker)  # bounded: a shared export's marker of nested brackets is one message
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise UserError(f"{marker}: unreadable ({exc}); nothing was loaded")
    if pins is None:
        check(record, model_dir, "export", retry)
        _now.exports[where] = record_pin(record)
    elif pins.get(where) != record_pin(record) and (problem := signature_problem(record)) is not None:
        raise Untrusted(f"{marker}: {problem}, and it is not the record the launching process checked (it changed "
                        "since, or no launch that checked it started this process); nothing was loaded")
    listing = f"{EXPORT_INFO}: hashes"
    problem = (verify(model_dir, record.get("hashes"), listing=listing)  # its shape checked too
               or unlisted(model_dir, record.get("hashes"), [EXPORT_INFO], listing, "export"))
    if problem is not None:
        raise UserError(f"{model_dir}: damaged export ({problem}); nothing was loaded")
