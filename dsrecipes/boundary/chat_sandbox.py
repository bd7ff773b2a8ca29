"""Rendering a model directory's chat template as the hostile input it may be (owner: boundary/): in a child process
under operating-system limits, and one message (exit 2) for any failure.

A chat template ships with a model directory, so it is someone else's program. It is rendered in Jinja's
`ImmutableSandboxedEnvironment` (transformers' environment, chat_render_child.py) in a persistent child process of
this one, started on the first render and reused, one per process (a data-preparation worker starts its own); a lock
makes the threads of a process take turns. Training renders a chunk of conversations (each with its prefixes) in
one request (`render_chunk`, cut at REQUEST_RENDERS renders / ~REQUEST_CHARS characters): a round trip per
conversation cost ~35% of the encoding throughput, one per chunk a few percent (benchmarks/bench_chat_sandbox.py).
The operating system bounds what the template can do:
- memory: the child's address space is limited (RLIMIT_AS, `MAX_MEMORY`): past it an allocation fails in the child
  (MemoryError) or the child dies; this process allocates nothing for the template but the request and the reply;
- time: the parent waits for the reply at most `MAX_SECONDS` of wall-clock time, then SIGKILLs the child; the child
  also has `MAX_CPU_SECONDS` of CPU time per render (RLIMIT_CPU: SIGXCPU, then SIGKILL, from the kernel). Neither is
  an exception, so neither can be caught, by the template or by any `except` of ours;
- output: the child stops rendering past `MAX_OUTPUT` characters; the parent reads the reply's length before the
  reply and refuses one past the bound without reading it, and checks the text's length again once decoded;
- lifetime: the child SIGKILLs itself when this process exits, however it exits (a lifeline pipe), and is killed
  at exit; a forked child process forgets its parent's renderer and starts its own;
- environment: the child gets only LC_ALL, MALLOC_ARENA_MAX and TZ, runs `python -I -S -B` from `/`, and imports
  only the standard library and Jinja, so no credential of this process reaches it.
A child that dies, is killed or runs out of memory is discarded; the next render starts a fresh one.
Every failure is `TemplateRefused` (a UserError) naming the model directory. `TemplateRaised`, its subclass, is the
template declining this conversation (its `raise_exception`, an undefined key, a type error): training calls that a
bad row. Past a limit or reaching for Python internals (SecurityError) is never a row's fault.
This module is the only place a model-supplied template is rendered (chat, prompt-eval, training, validate).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from dsrecipes.core.errors import UserError

MAX_OUTPUT = 1 << 20  # characters of a rendered prompt
MAX_SECONDS = 2.0  # wall-clock seconds of one render (the parent kills the child past it)
MAX_CPU_SECONDS = 3  # CPU seconds of one render (RLIMIT_CPU, whole seconds: the kernel kills the child past it)
MAX_MEMORY = 256 << 20  # bytes of the child's address space (RLIMIT_AS)
REQUEST_RENDERS = 256  # renders in one request to the child (a chunk of conversations is cut into such requests)
REQUEST_CHARS = 1 << 20  # about this many characters of message text in one request (a larger conversation alone)
START_SECONDS = 60.0  # for a new child to import Jinja and say it is ready (a loaded machine included)
CHILD = Path(__file__).with_name("chat_render_child.py")
_LATE = "late"
Renders = List[Tuple[List[Dict[str, Any]], bool]]  # (messages, add_generation_prompt) of one conversation's renders
Job = Tuple[Optional[list], Renders]  # (tools, renders): one conversation, as the child reads it


class TemplateRefused(UserError):
    pass


class TemplateRaised(TemplateRefused):
    """The template declined this conversation; `detail` is its own message."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail

    def __reduce__(self) -> Any:  # crosses from a data-preparation worker process
        return (type(self), (str(self), self.detail))


class _Stopped(Exception):
    """A limit stopped the render (its reason); the child is gone or discarded."""


def _site_dirs() -> List[str]:
    """The directories the child imports Jinja (and MarkupSafe) from: where this interpreter finds them."""
    dirs = []
    for name in ("jinja2", "markupsafe"):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise _Stopped(f"chat templates are rendered with {name}, which is not installed")
        top = str(Path(spec.origin).parent.parent)
        if top not in dirs:
            dirs.append(top)
    return dirs


def _child_env() -> Dict[str, str]:
    env = {"LC_ALL": "C.UTF-8", "MALLOC_ARENA_MAX": "1"}  # one malloc arena: the address-space limit is for data
    if "TZ" in os.environ:  # strftime_now renders local time
        env["TZ"] = os.environ["TZ"]
    return env


class _Child:
    """One renderer process, its pipes and its lifeline (chat_render_child.py's protocol)."""

    def __init__(self) -> None:
        site = _site_dirs()
        lifeline, self.lifeline = os.pipe()  # the child holds the read end; only this process the write end
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", str(CHILD), str(lifeline), str(MAX_MEMORY), *site],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, pass_fds=(lifeline,),
                env=_child_env(), cwd="/", start_new_session=True)
        except OSError as exc:
            os.close(self.lifeline)
            raise _Stopped(f"the renderer process could not start ({exc})") from None
        finally:
            os.close(lifeline)
        self.pid, self.buffer = self.proc.pid, bytearray()
        self.inp, self.out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self.inp, False)
        try:
            ready = self.read(5, time.monotonic() + START_SECONDS)
        except _Stopped as exc:
            ready = str(exc).encode()
        if ready != b"ready":
            self.kill()
            raise _Stopped(f"the renderer process did not start within {START_SECONDS:g} s "
                           f"({'no answer' if ready == _LATE.encode() else 'it ended'})")

    def send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.inp, view):]
            except BlockingIOError:
                self._wait(self.inp, select.POLLOUT, deadline)
            except (BrokenPipeError, ConnectionResetError):
                raise _Stopped(self.death()) from None

    def read(self, n: int, deadline: float) -> bytes:
        """`n` bytes of the child's answers (read in large chunks: the answers to one request often come together)."""
        while len(self.buffer) < n:
            self._wait(self.out, select.POLLIN, deadline)
            chunk = os.read(self.out, max(n - len(self.buffer), 1 << 16))
            if not chunk:
                raise _Stopped(self.death())
            self.buffer += chunk
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    @staticmethod
    def _wait(fd: int, event: int, deadline: float) -> None:
        poller = select.poll()
        poller.register(fd, event)
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise _Stopped(_LATE)

    def alive(self) -> bool:
        """Not ended and not ending. A killed child's main thread is a zombie before its other thread has closed our
        pipe, and the kernel lets us reap it only after both: any of the three signs means it is gone."""
        if self.proc.poll() is not None:
            return False
        poller = select.poll()
        poller.register(self.out, select.POLLIN)
        if poller.poll(0):  # between renders the child never writes: readable means its end closed
            return False
        try:
            state = Path(f"/proc/{self.pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True  # no /proc of our pid namespace: the first two signs only
        return state not in (b"Z", b"X")

    def death(self) -> str:
        """Why the child ended (it closed its end of a pipe): its signal or exit code."""
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            return "the renderer process stopped answering"
        self.close()
        if code == -signal.SIGXCPU:
            return f"it used more than {MAX_CPU_SECONDS} s of CPU time"
        if code == -signal.SIGKILL:
            return f"the renderer process was killed (its memory is limited to {MAX_MEMORY >> 20} MiB)"
        if code < 0:
            return f"the renderer process died of {signal.Signals(-code).name}"
        return f"the renderer process exited with code {code}"

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()
        self.close()

    def close(self) -> None:
        """Close this process's ends of the pipes (a forked process's copies too, leaving its parent's child be)."""
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        if self.lifeline >= 0:
            os.close(self.lifeline)
            self.lifeline = -1


class _Renderer:
    """This process's child, started on first use and replaced after it dies or is discarded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.child: Optional[_Child] = None

    def render(self, source: str, context: Dict[str, Any], jobs: List[Job]) -> List[List[tuple]]:
        """Per job, (kind, text) for each of its renders until the first that is not a text; the jobs after one
        that the sandbox refused get no answers (chat_render_child.py)."""
        request = pickle.dumps((source, context, jobs, MAX_OUTPUT, MAX_CPU_SECONDS), protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            if self.child is not None and not self.child.alive():  # it died between renders
                self.discard()
            if self.child is None:
                self.child = _Child()
            try:
                return self._exchange(self.child, len(request).to_bytes(4, "big") + request,
                                      [len(renders) for _, renders in jobs])
            except BaseException:  # a limit, a dead child, or our own interruption: never reuse it mid-answer
                self.discard()
                raise

    def _exchange(self, child: _Child, request: bytes, counts: List[int]) -> List[List[tuple]]:
        child.send(request, time.monotonic() + MAX_SECONDS)
        out: List[List[tuple]] = []
        for count in counts:
            answers: List[tuple] = []
            while len(answers) < count and (not answers or answers[-1][0] == b"o"):
                answers.append(self._answer(child, time.monotonic() + MAX_SECONDS))
            out.append(answers)
            if answers[-1][0] not in (b"o", b"r"):  # the child ended the request here
                break
        return out

    @staticmethod
    def _answer(child: _Child, deadline: float) -> tuple:
        """One render's answer, within MAX_SECONDS of the previous one: its kind and text, or _Stopped."""
        header = child.read(5, deadline)
        kind, size = header[:1], int.from_bytes(header[1:], "big")
        if size > 4 * MAX_OUTPUT + 4096 or kind not in (b"o", b"r", b"s", b"m", b"b"):
            raise _Stopped(f"its output passed {MAX_OUTPUT} characters" if kind == b"o" else "a malformed answer")
        text = child.read(size, deadline).decode("utf-8", "surrogatepass")
        if kind == b"m":
            raise _Stopped(f"it needed more than {MAX_MEMORY >> 20} MiB of memory")
        if kind == b"b" or len(text) > MAX_OUTPUT:
            raise _Stopped(f"its output passed {MAX_OUTPUT} characters")
        return kind, text

    def discard(self) -> None:
        child, self.child = self.child, None
        if child is not None:
            child.kill()

    def after_fork(self) -> None:
        """In a forked process: the parent's child and lock are not ours (close our copies of its pipes)."""
        child, self.child = self.child, None
        if child is not None:
            child.close()
        self.lock = threading.Lock()


_RENDERER = _Renderer()
atexit.register(_RENDERER.discard)
os.register_at_fork(after_in_child=_RENDERER.after_fork)


def template_source(tokenizer: Any) -> Optional[str]:
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        own = own.get("default")
    return own if isinstance(own, str) else None


def render(tokenizer: Any, messages: List[Dict[str, Any]], tools: Optional[list] = None,
           add_generation_prompt: bool = False, where: Any = None) -> str:
    """The tokenizer's chat template applied to `messages`, within the limits; TemplateRefused otherwise."""
    return render_many(tokenizer, [(messages, add_generation_prompt)], tools, where)[0]


def render_many(tokenizer: Any, renders: Renders, tools: Optional[list] = None, where: Any = None) -> List[str]:
    """The template applied to each (messages, add_generation_prompt) of `renders` (a conversation and its prefixes,
    in one round trip to the child), each within the limits: the texts, or the first render's TemplateRefused."""
    got = render_chunk(tokenizer, [(renders, tools)], where)[0]
    if isinstance(got, TemplateRaised):
        raise got
    return got


def render_chunk(tokenizer: Any, jobs: List[Tuple[Renders, Optional[list]]],
                 where: Any = None) -> List[Union[List[str], TemplateRaised]]:
    """`render_many` of each (renders, tools) of `jobs` (a chunk of conversations), in as few round trips to the
    child as REQUEST_RENDERS and REQUEST_CHARS allow: per job its texts, or the TemplateRaised of its first render
    the template declined (that conversation's problem). Anything else (a limit, the sandbox refusing the template)
    is the whole chunk's TemplateRefused."""
    where = where or f"{getattr(tokenizer, 'name_or_path', None) or 'the model'}: chat_template"
    source = template_source(tokenizer)
    if source is None:
        raise TemplateRefused(f"{where}: the tokenizer has no chat_template, so prompts cannot be rendered")
    context = {k: v for k, v in getattr(tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)}
    out: List[Union[List[str], TemplateRaised]] = []
    for request in _requests(jobs):
        out += [_result(answers, where) for answers in _round_trip(source, context, [(t, r) for r, t in request],
                                                                    where)]
    return out


def _requests(jobs: List[Tuple[Renders, Optional[list]]]) -> Iterator[List[Tuple[Renders, Optional[list]]]]:
    """`jobs` in consecutive groups of at most REQUEST_RENDERS renders and about REQUEST_CHARS characters of
    message text (a larger job alone): one request each, so the child never holds much more than one render needs."""
    group: List[Tuple[Renders, Optional[list]]] = []
    renders = chars = 0
    for job in jobs:
        size = _chars(job[0])
        if group and (renders + len(job[0]) > REQUEST_RENDERS or chars + size > REQUEST_CHARS):
            yield group
            group, renders, chars = [], 0, 0
        group.append(job)
        renders, chars = renders + len(job[0]), chars + size
    if group:
        yield group


def _chars(renders: Renders) -> int:
    """About the characters of a conversation's messages (its prefixes are the same objects: pickled once)."""
    longest = max((messages for messages, _ in renders), key=len, default=[])
    return sum(len(m["content"]) if isinstance(m, dict) and isinstance(m.get("content"), str) else 1024
               for m in longest)


def _round_trip(source: str, context: Dict[str, Any], jobs: List[Job], where: str) -> List[List[tuple]]:
    started = time.monotonic()
    try:
        return _RENDERER.render(source, context, jobs)
    except _Stopped as exc:
        reason = f"it ran longer than {MAX_SECONDS:g} s" if str(exc) == _LATE else str(exc)
        raise TemplateRefused(f"{where}: chat template stopped: {reason} ({time.monotonic() - started:.1f} s); "
                              "dsrecipes renders a model's template in a child process with time, memory and "
                              "output limits") from None


def _result(answers: List[tuple], where: str) -> Union[List[str], TemplateRaised]:
    """One job's texts, or the TemplateRaised of the render the template declined; TemplateRefused otherwise."""
    kind, text = answers[-1]
    if kind == b"o":
        return [text for _, text in answers]
    name, _, detail = text.partition("\0")
    if kind == b"s":
        raise TemplateRefused(f"{where}: chat template refused: {name}: {detail}; dsrecipes renders a model's "
                              "template in a sandbox")
    return TemplateRaised(f"{where}: the chat template cannot render this conversation ({name}: {detail})", detail)
