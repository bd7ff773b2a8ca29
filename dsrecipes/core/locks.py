"""OS file locks (flock) that end with their holder: a killed process cannot leave a stale lock behind.

`ExclusiveLock` is what the launching process holds on a run directory for the whole run; it writes who holds it
into the lock file, so a second run can name the holder. `SharedLock` is what every rank holds while it runs, so a
rank that outlives its launching process (SIGKILL, OOM killer) still keeps new runs out; `probe_free` is how the
next launching process checks for such ranks. flock locks belong to an open file, not to a path or a process:
two opens in one process conflict like two processes do, which is what lets one test process start two runs.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from dsrecipes.core.fileio import read_json_file


class LockHeld(Exception):
    """The lock is held by someone else; `holder` says who, as far as we can tell."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is locked by {holder}")
        self.path = path
        self.holder = holder


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _try_flock(fd: int, mode: int) -> bool:
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise


PROBE_S = 0.25  # a lock held this long is a holder, not someone's probe of it


class ExclusiveLock:
    """`with ExclusiveLock(path, info):` or `acquire()`/`release()`. Raises LockHeld when it is taken (held for
    PROBE_S: a probe holds it for an instant only)."""

    def __init__(self, path: Path, info: Optional[Dict[str, Any]] = None):
        self.path = Path(path)
        self.info = info or {}
        self.fd: Optional[int] = None

    def acquire(self) -> "ExclusiveLock":
        fd = _open(self.path)
        deadline = time.monotonic() + PROBE_S
        while not _try_flock(fd, fcntl.LOCK_EX):  # a probe (is_held, probe_free) holds it for an instant: try again
            if time.monotonic() >= deadline:
                os.close(fd)
                raise LockHeld(self.path, describe_holder(self.path))
            time.sleep(0.005)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv), **self.info}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # the holder's name goes with the lock
            os.close(self.fd)  # closing the last descriptor of the open file releases the flock
            self.fd = None

    def __enter__(self) -> "ExclusiveLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


SHARED_WAIT_S = 30.0  # a launching process's probe holds the exclusive lock for an instant; anything longer is not one
WAIT_NOTE_S = 2.0  # a wait for a lock longer than this is said on the console


class SharedLock:
    """A lock any number of holders share; an exclusive probe fails while one is held. Waits for a probe to pass,
    up to SHARED_WAIT_S (then LockHeld names the holder): a process that keeps it exclusively is not a probe."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd: Optional[int] = None

    def acquire(self) -> "SharedLock":
        fd = _open(self.path)
        started, said = time.monotonic(), False
        while not _try_flock(fd, fcntl.LOCK_SH):
            waited = time.monotonic() - started
            if waited >= SHARED_WAIT_S:
                os.close(fd)
                raise LockHeld(self.path, f"{describe_holder(self.path)} for {waited:.0f} s")
            if not said and waited >= WAIT_NOTE_S:
                said = True
                print(f"dsrecipes: waiting for {self.path}, held by {describe_holder(self.path)} (up to "
                      f"{SHARED_WAIT_S:.0f} s)", file=sys.stderr, flush=True)
            time.sleep(0.05)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def probe_free(path: Path) -> Optional[str]:
    """None when nobody holds a lock on `path` (checked by taking and dropping an exclusive lock), else who does."""
    fd = _open(path)
    try:
        if _try_flock(fd, fcntl.LOCK_EX):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        return describe_holder(path)
    finally:
        os.close(fd)


_PROBE_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK  # a probe: no write, and a FIFO is no wait


def is_held(path: Path) -> bool:
    """True while someone holds an exclusive lock on `path` (a shared probe would block). Costs three syscalls.
    Opened without blocking: a FIFO put where the lock file should be (shared storage is anyone's) is no wait."""
    try:
        fd = os.open(path, _PROBE_FLAGS)
    except OSError:
        return False
    try:
        return _held(fd)
    finally:
        os.close(fd)


def probe_held(path: Path) -> Optional[bool]:
    """is_held for a watcher that must not conclude from an error: False only when the file is gone or a shared lock
    on it is free, None when it cannot be told (shared storage's transient ESTALE, EIO, ENOLCK: the holder may well
    be alive)."""
    try:
        fd = os.open(path, _PROBE_FLAGS)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        return _held(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _held(fd: int) -> bool:
    if _try_flock(fd, fcntl.LOCK_SH):
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    return True


_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # a filesystem without flock


def try_shared(fd: int) -> bool:
    """A shared lock on the open file `fd` without waiting (a reader of a checkpoint holds one on its complete.json
    while it reads: `unread` then leaves that checkpoint alone). False while someone holds it exclusively; True
    where the filesystem has no flock (there is nobody to agree with)."""
    try:
        return _try_flock(fd, fcntl.LOCK_SH)
    except OSError as exc:
        if exc.errno in _NO_FLOCK:
            return True
        raise


@contextmanager
def unread(path: Path) -> Iterator[bool]:
    """True, holding an exclusive lock on `path` until the block ends, when no reader holds a shared one (see
    `try_shared`); also True when `path` is missing or its filesystem has no flock. A run's checkpoint retention
    removes a checkpoint only inside this, so a `dsrecipes export` of it running beside the run is not cut short."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        yield True
        return
    try:
        try:
            free = _try_flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
            free = True
        yield free
    finally:
        os.close(fd)


LOCK_INFO_BYTES = 64 << 10  # pid, host, since and a command line


def describe_holder(path: Path) -> str:
    """'pid 123 on host h since 2026-..., `command`' from the lock file, else the pids the kernel lists for it."""
    try:  # bounded: a lock in a shared cache is anyone's file (a FIFO, nested brackets, a list)
        info = read_json_file(path, "nested too deeply", limit=LOCK_INFO_BYTES)
    except (OSError, ValueError):  # empty (not yet written), damaged, too large, too deep, not a regular file
        info = {}
    info = info if isinstance(info, dict) else {}
    if info.get("pid"):
        text = f"pid {info['pid']} on {info.get('host', '?')} since {info.get('since', '?')}"
        return text + (f" (`{info['command']}`)" if info.get("command") else "")
    pids = lock_holder_pids(path)
    return f"process(es) {', '.join(map(str, pids))}" if pids else "another process"


def lock_holder_pids(path: Path) -> List[int]:
    """Pids holding a flock on `path`, from /proc/locks (Linux; empty elsewhere or when not visible)."""
    try:
        inode = os.stat(path).st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    pids = []
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (blocked waiters have a "->" column first)
        if "->" in parts:
            continue
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(inode):
            pids.append(int(parts[4]))
    return sorted(set(pids))
