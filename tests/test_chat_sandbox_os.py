"""The operating-system limits of the chat-template renderer (dsrecipes/boundary/chat_sandbox.py, chat_render_child.py):
a time limit no `except` can catch (the parent SIGKILLs the child), the child's address-space limit, the size of an
answer checked before it is read, a crashed child replaced, a child that never outlives its parent and gets none of
its parent's environment. (Memory bombs by kind: test_chat_sandbox_memory.py; on the training side:
test_template_sandbox_train.py; chat / prompt-eval: test_trust.py.)"""

from __future__ import annotations

import ast
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from dsrecipes.boundary import chat_sandbox
from dsrecipes.boundary.chat_sandbox import MAX_OUTPUT, TemplateRaised, TemplateRefused, render

REPO = Path(__file__).resolve().parents[1]
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
HI = [{"role": "user", "content": "hi"}]
# A loop whose time goes to code that catches exceptions: the old sandbox's alarm, an exception raised wherever the
# template happened to be, landed in its own `except Exception: pass` (sizing `%` against `self`, whose lookups are
# Python code) about one render in ten (measured: 1 of 10), and that render then ran for ever.
CATCHING = ("{% block a %}{% endblock %}{% set f = '%(a).0s' * 200 %}"
            "{% for i in range(100000) %}{% for j in range(100000) %}{% set x = f % self %}{% endfor %}{% endfor %}")
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% set x = 'x'|int %}{% endfor %}{% endfor %}"

class Tokenizer:
    name_or_path = "hostile-model"
    special_tokens_map: dict = {}

    def __init__(self, chat_template: str):
        self.chat_template = chat_template


def outcome(template: str, messages=HI):
    try:
        return render(Tokenizer(template), messages)
    except TemplateRefused as exc:
        return exc


def child_pid() -> int:
    render(Tokenizer(PLAIN), HI)
    return chat_sandbox._RENDERER.child.pid


@pytest.fixture
def fresh_child():
    """A renderer started after the test's changes (limits are fixed when the child starts)."""
    chat_sandbox._RENDERER.discard()
    yield
    chat_sandbox._RENDERER.discard()


def gone(pid: int, within: float) -> bool:
    """Whether `pid` has ended (or is a zombie nobody reaped) within `within` seconds."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return True
        if "\nState:\tZ" in state:
            return True
        time.sleep(0.05)
    return False


def test_a_template_that_catches_exceptions_in_a_loop_cannot_escape_the_time_limit(monkeypatch):
    monkeypatch.setattr(chat_sandbox, "MAX_SECONDS", 0.3)
    results: list = []

    def renders() -> None:
        for _ in range(12):  # the old alarm was swallowed about once in ten renders
            results.append(outcome(CATCHING))

    started = time.monotonic()
    thread = threading.Thread(target=renders, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"a render ran on past its limit ({len(results)} of 12 done)"
    assert len(results) == 12 and time.monotonic() - started < 60
    for result in results:
        assert isinstance(result, TemplateRefused) and not isinstance(result, TemplateRaised), result
        assert "chat template stopped: it ran longer than 0.3 s" in str(result), result
    assert render(Tokenizer(PLAIN), HI) == "user: hi\n"


def test_the_time_limit_kills_the_child(monkeypatch):
    """Not an exception in the child: the process itself ends (SIGKILL), whatever its code would catch."""
    monkeypatch.setattr(chat_sandbox, "MAX_SECONDS", 0.3)
    pid = child_pid()
    assert "ran longer than 0.3 s" in str(outcome(LOOP))
    assert gone(pid, 5)


def test_the_cpu_limit_is_the_kernels(monkeypatch, fresh_child):
    """With the wall clock far away, RLIMIT_CPU ends the render: SIGXCPU from the kernel, one message."""
    monkeypatch.setattr(chat_sandbox, "MAX_SECONDS", 30.0)
    monkeypatch.setattr(chat_sandbox, "MAX_CPU_SECONDS", 1)
    started = time.monotonic()
    result = outcome(LOOP)
    assert "chat template stopped: it used more than 1 s of CPU time" in str(result), result
    assert time.monotonic() - started < 25
    assert render(Tokenizer(PLAIN), HI) == "user: hi\n"


@pytest.mark.parametrize("template", [
    "{% set x = 'x' * 300000000 %}",  # one allocation past the limit
    "{% set ns = namespace(l=[]) %}{% for i in range(100) %}{% set ns.l = ns.l + ['y' * (10000000 + i)] %}{% endfor %}",
])
def test_a_template_that_allocates_past_the_address_space_limit_is_stopped(monkeypatch, fresh_child, template):
    monkeypatch.setattr(chat_sandbox, "MAX_SECONDS", 30.0)  # the memory limit stops it, even on a busy machine
    tracemalloc.start()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        result = outcome(template)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(result, TemplateRefused) and not isinstance(result, TemplateRaised), result
    message = str(result)
    assert message.count("chat template stopped:") == 1, message
    assert f"more than {chat_sandbox.MAX_MEMORY >> 20} MiB" in message or "was killed" in message, message
    assert peak < 2**20, peak  # the child allocated it, not this process
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB
    assert render(Tokenizer(PLAIN), HI) == "user: hi\n"


def test_the_childs_limits_and_environment(monkeypatch, fresh_child):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cret")
    monkeypatch.setenv("HF_TOKEN", "hf_s3cret")
    pid = child_pid()
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert {e.split(b"=")[0] for e in environ if e} <= {b"LC_ALL", b"MALLOC_ARENA_MAX", b"TZ"}, environ
    limits = Path(f"/proc/{pid}/limits").read_text()
    address = next(line for line in limits.splitlines() if line.startswith("Max address space")).split()
    assert int(address[3]) == chat_sandbox.MAX_MEMORY, limits
    assert next(line for line in limits.splitlines() if line.startswith("Max core file size")).split()[4] == "0"
    fds = sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))
    assert len(fds) == 4 and fds[:3] == [0, 1, 2], fds  # its two pipes, /dev/null, the lifeline
    assert os.readlink(f"/proc/{pid}/cwd") == "/"


def test_an_answer_past_the_output_limit_is_refused():
    result = outcome("{{ 'x' * 600000 }}{{ 'y' * 600000 }}")
    assert "chat template stopped: its output passed" in str(result), result
    assert render(Tokenizer("{{ 'x' * 1000 }}"), HI) == "x" * 1000


def test_the_parent_reads_the_length_of_an_answer_before_the_answer():
    """A child that claims a huge answer (it never does: this process checks anyway) is refused unread."""
    reads = []

    class Child:
        def read(self, n: int, deadline: float) -> bytes:
            reads.append(n)
            return b"o" + (8 * MAX_OUTPUT).to_bytes(4, "big")

    with pytest.raises(chat_sandbox._Stopped, match="output passed"):
        chat_sandbox._Renderer._answer(Child(), time.monotonic() + 1)
    assert reads == [5]


def test_a_crashed_child_is_replaced_and_the_next_render_works(monkeypatch):
    monkeypatch.setattr(chat_sandbox, "MAX_SECONDS", 10.0)
    pid = child_pid()
    os.kill(pid, signal.SIGSEGV)  # between renders: replaced without a message
    assert gone(pid, 5)
    child, end = chat_sandbox._RENDERER.child, time.monotonic() + 5
    while child.alive() and time.monotonic() < end:  # where /proc is another pid namespace's, gone() says nothing
        time.sleep(0.05)
    assert render(Tokenizer(PLAIN), HI) == "user: hi\n"
    pid = chat_sandbox._RENDERER.child.pid
    threading.Timer(0.5, os.kill, (pid, signal.SIGSEGV)).start()  # during one
    started = time.monotonic()
    result = outcome(LOOP)
    assert "chat template stopped: the renderer process died of SIGSEGV" in str(result), result
    assert time.monotonic() - started < 8
    assert render(Tokenizer(PLAIN), HI) == "user: hi\n"


def test_a_dying_child_not_yet_reapable_is_replaced_without_a_message(monkeypatch):
    """The kernel may show a dead child as running (a core dump, another pid namespace's /proc) while its end of
    our pipe is already closed: the hang-up alone says it is gone, and the next render gets a fresh child."""
    monkeypatch.setattr(chat_sandbox, "MAX_SECONDS", 10.0)
    pid = child_pid()
    child = chat_sandbox._RENDERER.child
    monkeypatch.setattr(child.proc, "poll", lambda: None)  # not reapable yet, as far as this process can tell
    os.kill(pid, signal.SIGKILL)
    assert gone(pid, 5)
    assert render(Tokenizer(PLAIN), HI) == "user: hi\n"
    assert chat_sandbox._RENDERER.child.pid != pid


def test_a_renderer_that_cannot_start_is_one_message_naming_the_model(monkeypatch, fresh_child):
    monkeypatch.setattr(chat_sandbox, "CHILD", Path("/nonexistent/chat_render_child.py"))
    result = outcome(PLAIN)
    assert isinstance(result, TemplateRefused) and not isinstance(result, TemplateRaised), result
    assert str(result).startswith("hostile-model: chat_template: chat template stopped: the renderer process did not "
                                  "start"), result
    monkeypatch.undo()
    assert render(Tokenizer(PLAIN), HI) == "user: hi\n"


def test_the_child_never_outlives_its_parent(tmp_path):
    script = ("import os, signal\nfrom dsrecipes.boundary import chat_sandbox as c\n"
              "class T:\n    name_or_path = 'm'; special_tokens_map = {}; chat_template = 'x'\n"
              "c.render(T(), [])\nprint(c._RENDERER.child.pid, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert gone(int(done.stdout.split()[0]), 10)  # SIGKILLed parent: no atexit ran, the lifeline did


def test_threads_and_forked_processes_each_get_their_answers():
    texts: dict = {}

    def one(i: int) -> None:
        texts[i] = render(Tokenizer(PLAIN), [{"role": "user", "content": str(i)}] * (i + 1))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    pid = os.fork()
    if pid == 0:  # a data-preparation worker's way: its own child, never its parent's pipes
        ok = render(Tokenizer(PLAIN), [{"role": "user", "content": "forked"}]) == "user: forked\n"
        os._exit(0 if ok else 1)
    for t in threads:
        t.join(30)
    assert os.waitpid(pid, 0)[1] == 0
    assert texts == {i: "".join(f"user: {i}\n" for _ in range(i + 1)) for i in range(6)}


def test_no_jinja_compiler_internals_and_no_ctypes():
    for module in ("chat_sandbox.py", "chat_render_child.py"):
        tree = ast.parse((REPO / "dsrecipes" / "boundary" / module).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {name for name in imported if name.split(".")[0] == "ctypes" or name == "jinja2.compiler"}, module
