"""What a run shows on the console, and what it keeps off it.

Progress: a bar on a terminal, one plain line per log step otherwise (a log file or a CI console gets lines, never
one 38 KB bar). The launching process decides (`progress_mode()`) and passes `DSRECIPES_PROGRESS=bar|lines` to the
ranks, whose output reaches the terminal through a pipe.

Third-party lines that tell the user nothing (DeepSpeed's "Setting accelerator to CPU" and "Attempting to get
learning rate from scheduler before it has started", the deepspeed launcher's INFO lines, deprecation warnings from
inside torch or DeepSpeed; Hugging Face progress bars such as "Loading weights" and "Writing model shards", on a
terminal too; tracker banners: trackers.py) are kept off the console and written to `<run>/logs/<process>.log`:
  - in our own processes (the launching process, every rank): `quiet_third_party()` filters DeepSpeed's logger and
    sends deprecation warnings (FutureWarning, DeprecationWarning) to the log; other warnings are shown;
  - from launcher binaries (deepspeed, torchrun, mpirun) and everything they start: `relay()` reads their output
    and passes on what is not noise (torchrun's agent's own traceback and box after a rank failed included).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings
from pathlib import Path
from typing import IO, Callable, Iterator, List, Optional

from dsrecipes.core.errors import UserError
from dsrecipes.core.fileio import open_append, open_append_fd

PROGRESS_ENV = "DSRECIPES_PROGRESS"
LOGS_DIR = "logs"

NOISE = [re.compile(p) for p in (
    r"Setting accelerator to CPU\. If you have GPU or other accelerator",
    r"Attempting to get learning rate from scheduler before it has started",
    r"MPU is not provided, setting tp size to 1 in checkpoint loading",  # every elastic (universal) resume
    r"Unable to find hostfile, will proceed with training with local resources only",
    r"\[INFO\] \[(runner|launch)\.py:\d+:",  # the deepspeed launcher narrating itself (launch.txt has the command)
    r"\[ERROR\] \[launch\.py:\d+:sigkill_handler\]",  # a rank's exit code: commands/outcome.py says it in words
    r"DeepSpeed deepspeed\.ops\.\S+ built successfully",
    r"^\s*return func\(\*args, \*\*kwargs\)\s*$",  # the source line Python prints under a FutureWarning
    r"(FutureWarning|DeprecationWarning|UserWarning): .*(deprecated|will be removed)",
    r"^(Writing model shards|Loading checkpoint shards|Saving the dataset|Map)\b.*\|",  # HF progress bars
    r"^[IWE]\d{4} [\d:.]+ \d+ \S*torch/distributed/elastic/",  # torchrun's agent narrating itself (a rank's end)
    r"^\*{20,}\s*$|^Setting OMP_NUM_THREADS environment variable for each process to be 1",  # torchrun's banner
)]
# What torchrun's agent raises when a rank failed, printed as an uncaught traceback, then a box of '=' rules naming
# the ranks' exit codes: the launching process says the cause (commands/outcome.py); the log keeps it (`_Held`).
AGENT_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
# What it raises (no box) after it passed on a stop signal to its ranks: the launching process, which sent it, says
# how the run stopped (stopping.py); the log keeps it.
AGENT_SIGNALLED = "torch.distributed.elastic.multiprocessing.api.SignalException"


def is_noise(line: str) -> bool:
    return any(p.search(line) for p in NOISE)


def progress_mode() -> str:
    """`bar` on a terminal, else `lines`; DSRECIPES_PROGRESS=bar|lines decides when set (ranks get it)."""
    mode = os.environ.get(PROGRESS_ENV, "")
    if mode in ("bar", "lines"):
        return mode
    return "bar" if sys.stderr.isatty() else "lines"


def log_path(run_dir: Path, process: str) -> Path:
    return Path(run_dir) / LOGS_DIR / f"{process}.log"


class _Sink:
    """An append-only log file shared by the filters of this process (lines from threads are written whole)."""

    def __init__(self) -> None:
        self.path: Optional[Path] = None
        self.lock = threading.Lock()

    def write(self, text: str) -> None:
        if self.path is None:
            return
        with self.lock:
            with open_append(self.path) as fh:
                fh.write(text if text.endswith("\n") else text + "\n")


_SINK = _Sink()


class _DeepSpeedFilter(logging.Filter):
    """On DeepSpeed's logger: noise goes to the log file instead of the console."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not is_noise(message):
            return True
        _SINK.write(f"[{record.levelname}] [{record.filename}:{record.lineno}] {message}")
        return False


def quiet_third_party(path: Optional[Path]) -> None:
    """Keep third-party noise of this process off the console and in `path` (None: nowhere yet; idempotent; a later
    call moves the file). Call it before deepspeed, transformers and datasets are imported."""
    _SINK.path = None if path is None else Path(path)
    # Hugging Face's bars (loading weights, writing shards, map) say nothing our own lines do not; the run's own
    # progress bar is ours (metrics.py) and stays.
    for var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(var, "1")  # read when transformers / datasets are imported (ranks inherit it)
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    logger = logging.getLogger("DeepSpeed")  # created here if deepspeed is not imported yet; DeepSpeed adds its handler
    if not any(isinstance(f, _DeepSpeedFilter) for f in logger.filters):
        logger.addFilter(_DeepSpeedFilter())
    if not isinstance(warnings.showwarning, _WarningRouter):
        warnings.showwarning = _WarningRouter(warnings.showwarning)


def keep_in_log(text: str) -> None:
    """A third-party message this process recognised as noise: to its log file (quiet_third_party), not the console."""
    _SINK.write(text)


def current_log() -> Optional[Path]:
    """The log file this process keeps third-party noise in (quiet_third_party), if any yet."""
    return _SINK.path


class _ToLog:
    """A text stream whose lines (a progress bar's `\\r` frames too) go to the log file, none to the console."""

    def __init__(self) -> None:
        self.pending = ""

    def write(self, text: str) -> int:
        *lines, self.pending = re.split(r"[\r\n]", self.pending + text)
        for line in lines:
            if line.strip():
                _SINK.write(line)
        return len(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def kept_in_log() -> Iterator[None]:
    """What third-party code prints while the block runs (print, tqdm: DeepSpeed's zero_to_fp32 narrating a
    consolidation) goes to this process's log file; without one (quiet_third_party not called) it is shown."""
    if _SINK.path is None:
        yield
        return
    stream = _ToLog()
    try:
        with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):  # type: ignore[type-var]
            yield
    finally:
        stream.write("\n")


class _WarningRouter:
    """Deprecation notices from inside libraries go to the log file; other warnings (a DataLoader with more
    workers than cores, ...) are shown as usual."""

    HIDDEN = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)

    def __init__(self, show: Callable[..., None]):
        self.show = show

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if issubclass(category, self.HIDDEN):
            _SINK.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip())
        else:
            self.show(message, category, filename, lineno, file, line)


def command_log(argv: List[str], command: str) -> Optional[Path]:
    """Where a model command (export, chat, prompt-eval) keeps third-party noise: `<run>/logs/<command>.log` of the
    first run directory (one holding config.yaml, or its export directory) named on its command line."""
    from dsrecipes.core.rundir import CHECKPOINTS_DIR  # lazy: else `cli` imports yaml

    for arg in argv:
        named = Path(arg.partition("=")[2] if arg.startswith("--") else arg)  # a positional, or --flag=PATH
        for run in (named, named.parent):
            # a checkpoint (RUN/checkpoints/step_N holds a config.yaml too) is signed file by file: a log written
            # there damaged it (`export RUN/checkpoints/step_N` made the next export refuse it); its run's logs/
            run = next((p.parent for p in (run, *run.parents) if p.name == CHECKPOINTS_DIR and _holds_config(p.parent)),
                       run)
            if _holds_config(run):
                return log_path(run, command)
    return None


def _holds_config(run: Path) -> bool:
    """False for anything that is not a path here: `--message` text past NAME_MAX raised ENAMETOOLONG."""
    try:
        return (run / "config.yaml").is_file() and os.access(run, os.W_OK)
    except (OSError, ValueError):  # too long, a NUL byte (ValueError)
        return False


# ---------------------------------------------------------------------------------------------------------------
# A rank outliving its console


class _GuardedStream:
    """A console stream whose failed write or flush (`catches`) goes to `failed(exc)`: it raises, or makes the stream
    usable again and the write is made once more. Everything else is the stream's."""

    catches: type = OSError

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except self.catches as exc:
            self.failed(exc)
            return self._stream.write(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except self.catches as exc:
            self.failed(exc)
            self._stream.flush()

    def failed(self, exc: OSError) -> None:
        raise exc

    def __getattr__(self, name: str):  # noqa: ANN204 - everything else is the stream's
        return getattr(self._stream, name)


class _Survivor(_GuardedStream):
    """A rank's stdout/stderr, which is a pipe to the launching process's `relay`. A SIGKILLed launching process
    leaves that pipe without a reader, and the next print would raise BrokenPipeError in the middle of the step
    boundary where the rank checkpoints and stops (stopping.watch). The first broken write moves both console file
    descriptors onto `log` (dup2, so C-level writers follow too) and writes there."""

    catches = BrokenPipeError

    def __init__(self, stream: IO[str], log: Path) -> None:
        super().__init__(stream)
        self._log = Path(log)

    def failed(self, exc: OSError) -> None:
        _divert(self._log)


def _divert(log: Path) -> None:
    fd = open_append_fd(log)
    try:
        for target in (1, 2):
            os.dup2(fd, target)
    finally:
        os.close(fd)


def survive_lost_console(log: Path) -> None:
    """Ranks started behind a relay: keep writing (into `log`) when the launching process is gone. A line leaves in
    one write: under PYTHONUNBUFFERED (process._start) `print` writes text and newline apart, and two ranks sharing
    a pipe ran their lines together ('... float32dsrecipes: rank 0: ...'); line-buffered, they leave together."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):  # not a TextIOWrapper, or closed
            stream.reconfigure(line_buffering=True, write_through=False)
    if not isinstance(sys.stdout, _Survivor):
        sys.stdout = _Survivor(sys.stdout, log)  # type: ignore[assignment]
        sys.stderr = _Survivor(sys.stderr, log)  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------------------------
# A command's own output


class OutputLost(UserError):
    """Standard output refused a write: a full disk (`dsrecipes show > /dev/full`), an I/O error. One message naming
    standard output, exit 2, never a traceback."""


class OutputClosed(Exception):
    """Standard output's reader went away (`dsrecipes ls | head`): the command ends quietly with 141, the status of a
    process SIGPIPE ends, as Unix tools do. SIGPIPE itself stays ignored (Python's default, which cli.main keeps), so
    a write to one of our own pipes whose reader died (a preparation worker's, a relay's) is an error at that write,
    named there, and never kills the process without a word."""

    exit_code = 141


class _CheckedOutput(_GuardedStream):
    """A command's stdout (cli.main): the first failed write or flush is `OutputLost`. File descriptor 1 then points
    at /dev/null, so that the interpreter's own flush at exit (of what is still buffered) does not fail a second time
    with an 'Exception ignored' traceback."""

    def failed(self, exc: OSError) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            if self._stream.fileno() == 1:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.close(null)
        if isinstance(exc, BrokenPipeError):
            raise OutputClosed() from None
        reason = exc.strerror or type(exc).__name__
        raise OutputLost(f"could not write to standard output: {reason} (the output was not complete)") from None


@contextlib.contextmanager
def checked_output() -> Iterator[None]:
    """While a command runs, a failed write to stdout is `OutputLost` (cli.run_guarded flushes before it returns)."""
    stream = sys.stdout
    sys.stdout = _CheckedOutput(stream)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout = stream


# ---------------------------------------------------------------------------------------------------------------
# Relaying a launcher binary's output


def relay(stream: IO[bytes], console: IO[str], log: Path) -> threading.Thread:
    """Copy `stream` (a child's stdout or stderr pipe) to `console`, noise to `log`, in a daemon thread.

    Pieces end at a newline or a carriage return, so a progress bar (`\\r...`) moves as it is drawn; a line is
    judged whole. Returns the thread (join it after the child exits)."""
    sink, held = _Sink(), _Held()
    sink.path = Path(log)

    def pump() -> None:
        pending = b""
        for chunk in iter(lambda: os.read(stream.fileno(), 65536), b""):
            pending += chunk
            pieces = re.split(rb"(?<=[\r\n])", pending)
            pending = pieces.pop()  # the unfinished piece ('' when the chunk ended a line)
            _emit(held.route([p.decode("utf-8", "replace") for p in pieces], sink), console, sink)
        _emit(held.route([pending.decode("utf-8", "replace")] if pending else [], sink) + held.release(), console,
              sink)

    thread = threading.Thread(target=pump, name="dsrecipes-relay", daemon=True)
    thread.start()
    return thread


class _Held:
    """A traceback held back until its last line says whose it is: torchrun's agent's AGENT_FAILED, with the box
    after it (up to its second '=' rule), and its AGENT_SIGNALLED go to the log; any other is passed on as it came,
    in order."""

    def __init__(self) -> None:
        self.lines: List[str] = []
        self.rules = 0  # '=' rules of AGENT_FAILED's box still to come

    def route(self, pieces: List[str], sink: _Sink) -> List[str]:
        """The pieces to pass on (to _emit) now."""
        out: List[str] = []
        for piece in pieces:
            if self.rules:
                sink.write(piece.rstrip("\r\n"))
                self.rules -= bool(re.fullmatch(r"=+\s*", piece))
            elif self.lines and piece.startswith(" "):  # a frame, its source line, its carets
                self.lines.append(piece)
            elif self.lines and piece.startswith((AGENT_FAILED, AGENT_SIGNALLED)):
                for line in self.lines + [piece]:
                    sink.write(line.rstrip("\r\n"))
                self.lines, self.rules = [], 2 if piece.startswith(AGENT_FAILED) else 0
            elif piece.rstrip("\r\n") == "Traceback (most recent call last):":
                out += self.release()
                self.lines = [piece]
            else:
                out += self.release() + [piece]
        return out

    def release(self) -> List[str]:
        lines, self.lines = self.lines, []
        return lines


def _emit(pieces: List[str], console: IO[str], sink: _Sink) -> None:
    shown = []
    for piece in pieces:
        if is_noise(piece):
            sink.write(piece.rstrip("\r\n"))
        else:
            shown.append(piece)
    if shown:
        console.write("".join(shown))
        console.flush()


def exit_flushed(code: int) -> None:
    """End this process at once with `code` (no interpreter shutdown), what it printed flushed first (a lost console
    is no reason not to end)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
