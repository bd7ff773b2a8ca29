"""Command line: `dsrecipes SUBCOMMAND ...`, or Hydra training when no subcommand is given.

`python -m dsrecipes [hydra overrides]` and `dsrecipes [hydra overrides]` train (`-m` sweeps, `--cfg job` prints
the composition). A first word naming a subcommand dispatches to `dsrecipes.commands.<module>.main(argv)`; this
file only routes and turns a UserError into one clean message with exit code 2.
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import gc
import importlib
import os
import select
import signal
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import dsrecipes.boundary.trust as trust
import dsrecipes.core.failure as failure
import dsrecipes.core.stopping as stopping
from dsrecipes.commands.help import version_text
from dsrecipes.core.console import (
    OutputClosed,
    checked_output,
    command_log,
    current_log,
    exit_flushed,
    quiet_third_party,
)
from dsrecipes.core.errors import UserError
from dsrecipes.core.paths import user_cache_dir
from dsrecipes.core.suggest import closest, phrase

# subcommand -> (module under dsrecipes.commands, one-line help). The module exposes `main(argv) -> int`.
SUBCOMMANDS: Dict[str, Tuple[str, str]] = {
    "train": ("train", "train (same as no subcommand): compose, validate, prepare, launch"),
    "validate": ("validate", "validate one composition, or --all recipes x group options"),
    "show": ("show", "print the resolved config and the generated DeepSpeed JSON"),
    "ls": ("ls", "list config groups, their options and the recipes"),
    "audit": ("audit", "prove exactly-once / equal-steps data plans for a world size"),
    "shard": ("shard", "split data into one part file per rank (+ manifest)"),
    "inspect-data": ("inspect_data", "render samples with trained tokens highlighted, plus statistics"),
    "estimate": ("estimate", "memory per GPU/CPU for every ZeRO stage and offload choice"),
    "doctor": ("doctor", "check the environment (torch, CUDA, compilers, shm, caches)"),
    "prompt-eval": ("prompt_eval", "answers of a baseline and a fine-tuned model side by side"),
    "chat": ("chat", "chat with a trained model in the terminal, on the template it was trained on"),
    "export": ("export", "write a Hugging Face model directory from a run's checkpoint"),
    "score": ("score", "score preference pairs with a reward model: accuracy, margin, rewards as JSONL"),
    "pipeline": ("pipeline", "run stages in order (SFT -> reward -> DPO), each feeding the next; resumable"),
    "node": ("node", "join a multi-node run without ssh as node N > 0 (launch/multinode_nossh.sh runs it)"),
}

# commands of llamafactory-cli (and `merge`) that are not ours -> what does their job here
OTHER_TOOLS_COMMANDS = {
    "eval": "dsrecipes prompt-eval --baseline RUN --finetuned RUN (held-out answers and scores side by side); "
            "every run also evaluates every trainer.eval_every steps",
    "merge": "dsrecipes export RUN --out DIR (a LoRA run: merged by default, --lora adapter for the adapter alone)",
    "api": "export/ of a run is a Hugging Face model directory with its chat template: serve it with vLLM, TGI or "
           "transformers; dsrecipes chat RUN talks to it in the terminal",
    "webchat": "dsrecipes chat RUN (in the terminal)",
    "webui": "no web UI: recipes and KEY=VALUE overrides (dsrecipes ls, dsrecipes train --help)",
    "env": "dsrecipes doctor (environment report with fixes), dsrecipes --version",
    "version": "dsrecipes --version",
}

# third-party bars and warnings go to a run's log
QUIET_COMMANDS = ("export", "chat", "prompt-eval", "inspect-data", "score")


def entry() -> None:
    """The `dsrecipes` console script and `python -m dsrecipes`: `main()`, then the end of the process.

    A Ctrl-C or SIGTERM after the command returned (its work done and reported, while torch and DeepSpeed tear down,
    up to ~1 s) ends the process at once with the command's own exit code (was: a death by that signal after
    `exported ...`, 130/143, so a script's `dsrecipes export ... && next` saw a failure). What is still alive is
    frozen out of the cyclic collector (gc.freeze): the interpreter's last collections would otherwise walk every
    object torch, transformers and DeepSpeed created (~0.6-1.4 CPU s per process); every file was closed by its owner
    before this point. Not in `main`, which tests call in their own process.

    A stop signal in the instant between the command's own handling (run_guarded) and these handlers - a second
    Ctrl-C while the result travels back, stretched by a collection on a slow machine - ends the process with the
    signal's exit code too, after the one message the command printed (was: Python's death by SIGINT, or SIGTERM's,
    -2/-15 to a parent; seen once in a test run, 1.5 s after an interrupted pipeline's resume line). Python's own
    teardown after SystemExit (its handlers given back after the atexit functions) is still a death by the signal."""
    try:
        with stopping.raising():  # every block that changes SIGTERM's handler restores this one, the tail included
            code = console_main()
    except KeyboardInterrupt as exc:
        if stopping.requested() is None:  # no interruption said yet (an interrupted command said its own)
            print("interrupted", file=sys.stderr, flush=True)
        code = stopping.exit_code(stopping.signal_of(exc))
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _exit_now(code))
    gc.freeze()
    raise SystemExit(code)


def console_main(argv: Optional[Sequence[str]] = None) -> int:
    """`main` as the console script runs it: a crash (an exception that is no refusal, e.g. a bug) is one `error:`
    line naming its type, message and file:line, its traceback kept in the command's log (a run's logs/main.log)
    or in a file of its own under the user's cache; exit 1 (DSRECIPES_TRACEBACK=1: the traceback instead)."""
    try:
        return main(argv)
    except Exception as exc:  # noqa: BLE001 - whatever no command turned into a message
        if os.environ.get(failure.TRACEBACK_ENV) == "1":
            raise
        log = current_log() or user_cache_dir() / "dsrecipes" / "crashes" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        print(f"error: {failure.crash_line(exc, log)}", file=sys.stderr, flush=True)
        return 1


def _exit_now(code: int) -> Callable[[int, Any], None]:
    def handler(signum: int, frame: Any) -> None:
        exit_flushed(code)

    return handler


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    trust.reset()  # trusting a checkpoint is a decision of one command line, never carried over
    with checked_output():  # `dsrecipes show > /dev/full`: one message, not a traceback
        return run_guarded(_route, args)


def _route(args: List[str]) -> int:
    if args and args[0] in ("-h", "--help") and len(args) == 1:
        print(usage())
        return 0
    if args and args[0] in ("-V", "--version"):
        print(version_text())
        return 0
    if args and args[0] == "help":  # llamafactory-cli's `help`; `dsrecipes help CMD` is `dsrecipes CMD --help`
        args = _help_args(args[1:])
        if not args:
            print(usage())
            return 0
    if args and args[0] in SUBCOMMANDS:
        name, rest = args[0], args[1:]
    else:
        name, rest = "train", args
    _check_command(args)
    return _dispatch(name, rest)


def _dispatch(name: str, rest: List[str]) -> int:
    """Everything after routing runs under run_guarded: a malformed flag is a message and a Ctrl-C while the
    command's modules import is `interrupted` (exit 130), never a traceback."""
    if name == "train":  # Hydra's parser owns train's arguments: the flag is taken off before it sees them
        rest = trust.take_flag(rest)
    if name in QUIET_COMMANDS:  # before deepspeed / transformers load (train quiets itself once its run dir is known)
        quiet_third_party(command_log(rest, name))
    return importlib.import_module(f"dsrecipes.commands.{SUBCOMMANDS[name][0]}").main(rest)


def run_guarded(fn: Callable[[List[str]], int], argv: List[str]) -> int:
    """Run a subcommand; user mistakes print one message and exit 2, never a traceback. SIGTERM stops it as Ctrl-C
    does (stopping.raising; the launch records it instead, to stop at a step boundary): exit 143 or 130."""
    try:
        with stopping.raising(), _interrupts_not_swallowed():
            code = int(fn(argv) or 0)
            sys.stdout.flush()  # a full stdout (checked_output) fails here, as a message, not at interpreter exit
            return code
    except UserError as exc:
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    except OutputClosed as exc:  # `dsrecipes ls | head`: quietly, as SIGPIPE would end it (SIGPIPE stays ignored)
        return exc.exit_code
    except OSError as exc:
        if exc.errno == errno.EPIPE and exc.filename is None and _console_closed():
            return OutputClosed.exit_code  # `... 2>&1 | head`: stderr's reader went away too; nowhere to say more
        if exc.errno != errno.ENAMETOOLONG:
            raise
        name = str(exc.filename)  # every path a command takes, wherever it is first looked at
        print(UserError(f"{name[:200]}{'...' if len(name) > 200 else ''}: file name too long (a name of more than "
                        "255 bytes, or a path of more than 4096); give a shorter path").render(), file=sys.stderr)
        return UserError.exit_code
    except KeyboardInterrupt as exc:
        if not getattr(exc, "said", False):  # (train's launch says how its run stopped, with the resume command)
            print("interrupted", file=sys.stderr)
        return stopping.exit_code(stopping.signal_of(exc))


def _console_closed() -> bool:
    """Whether stderr is a pipe whose reader went away (poll: POLLERR on its write end); a file or a terminal is not."""
    try:
        poller = select.poll()
        poller.register(sys.stderr.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def _interrupts_not_swallowed() -> Iterator[None]:
    """A Ctrl-C (or SIGTERM's Stopped) raised while a `__del__` or weakref callback runs (regex's Group.__del__ while
    transformers imports) is 'ignored' by Python: an 'Exception ignored in' traceback, and the command went on to exit
    0. Such an interrupt is delivered again to the main flow instead, where run_guarded ends it as any other."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):  # later, from a thread: raised in here, it is lost
            _thread.start_new_thread(_interrupt_later, (stopping.signal_of(unraisable.exc_value),))
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _interrupt_later(signum: int) -> None:
    time.sleep(0.01)  # past the hook's return (its own bytecode would receive the interrupt and lose it again)
    _thread.interrupt_main(signum)


def _help_args(words: List[str]) -> List[str]:
    """`dsrecipes help [COMMAND]`: nothing (the usage) or COMMAND's own --help."""
    if not words:
        return []
    if len(words) > 1 or words[0] not in SUBCOMMANDS:
        raise UserError(f"dsrecipes help takes one command, not {' '.join(words)!r}{phrase(closest(words[0], SUBCOMMANDS))} "
                        f"(commands: {', '.join(SUBCOMMANDS)})")
    return [words[0], "--help"]


def _check_command(args: List[str]) -> None:
    """A first word close to a subcommand, and neither a flag nor an override, is a mistyped subcommand (other bare
    words reach the training command, which names the closest keys and groups)."""

    word = args[0] if args else ""
    if word in OTHER_TOOLS_COMMANDS:
        raise UserError(f"unknown command '{word}'; for that here: {OTHER_TOOLS_COMMANDS[word]}")
    near = closest(word, SUBCOMMANDS)
    if near and word not in SUBCOMMANDS and not word.startswith(("-", "~", "+")) and "=" not in word:
        raise UserError(f"unknown command '{word}'{phrase(near)} "
                        f"(commands: {', '.join(SUBCOMMANDS)}; training takes KEY=VALUE overrides)")


def usage() -> str:
    lines = ["usage: dsrecipes [SUBCOMMAND] [overrides...]   (dsrecipes --version, dsrecipes train --help)", "",
             "Without a subcommand: train (a Hydra app: `-m` sweeps, `--cfg job` prints the composition, "
             "`--hydra-help` shows Hydra's flags). `dsrecipes ls` lists groups, options and recipes.", "",
             "From LLaMA-Factory: `dsrecipes validate recipe=YOUR_LF.yaml` names each key's spelling here and prints "
             "the file in our keys; save that and `dsrecipes train FILE.yaml`.", ""]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)
