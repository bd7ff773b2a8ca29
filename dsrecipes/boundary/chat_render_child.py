"""The child process that renders model-supplied chat templates (owner: boundary/; started only by chat_sandbox.py).

Run as a script, `python -I -S -B chat_render_child.py SITE_DIR...`, with a minimal environment: it imports only the
standard library and Jinja (from the directories the parent names), so nothing of dsrecipes, no credential and no
file of the run is in reach of the template. Before it answers the first request it limits itself:
- RLIMIT_AS (address space, `argv`'s MEMORY bytes): an allocation past it is MemoryError, or the process dies;
- RLIMIT_CORE 0 (a process the kernel stops writes no core file);
- RLIMIT_CPU, moved before each render to the CPU seconds used so far plus the render's allowance: past it the
  kernel sends SIGXCPU, whose default action ends the process (no handler is ever installed here, and a template
  cannot install one); the parent's wall-clock timeout (SIGKILL) bounds a render in any case;
- a lifeline: a thread blocks on a pipe whose only writer is the parent; when the parent exits, however it exits,
  the read returns and the thread SIGKILLs this process (what PR_SET_PDEATHSIG does, without ctypes).

Protocol (stdin/stdout, binary): a request is a 4-byte big-endian length and a pickle of (source, context, jobs,
max_output, cpu_seconds) written by the parent (trusted); `jobs` is a list of (tools, renders), `renders` a list of
(messages, add_generation_prompt) to render with the context and that job's tools (a conversation and its prefixes;
a chunk of conversations is one request: one round trip). Each render is answered as soon as it is done (answers
done within FLUSH_SECONDS of each other go together); a job's answers end at its first answer that is not a text,
the request's at the first that is neither a text nor `r`; an answer is one kind byte, a 4-byte length and UTF-8
(surrogatepass):
  o  the rendered text
  r  the template raised (its `raise_exception`, an undefined key, a type error): "TypeName\\0message"
  s  the sandbox refused it (SecurityError, TemplateSyntaxError): "TypeName\\0message"
  m  it ran out of memory (MemoryError)
  b  its output passed `max_output` characters (rendering streams and stops there)
The environment is transformers' (`ImmutableSandboxedEnvironment`, trim_blocks, lstrip_blocks, loopcontrols,
`raise_exception`, `tojson`, `strftime_now`, a `{% generation %}` block that renders its body, `namespace` without
underscore names).
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import signal
import sys
import threading
import time
from datetime import datetime

DETAIL = 2000  # characters of an exception's message sent back
FLUSH_SECONDS = 0.01  # answers done within this of the last ones sent go back together (one wake-up of the parent)


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _reply(kind: bytes, text: str = "") -> bytes:
    body = text.encode("utf-8", "surrogatepass")
    return kind + len(body).to_bytes(4, "big") + body


def _lifeline(fd: int) -> None:
    """Block until the parent's end of the lifeline closes (the parent exited), then end this process."""
    try:
        while os.read(fd, 1):
            pass
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __setitem__(self, name, value):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}")
            super().__setitem__(name, value)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=Namespace, strftime_now=strftime_now)
    return env


def _render(env, compiled: dict, source: str, context: dict, max_output: int) -> bytes:
    """One reply: the text, or why there is none (the module docstring's kinds)."""
    from jinja2.exceptions import SecurityError, TemplateSyntaxError

    try:
        template = compiled.get(source)
        if template is None:
            if len(compiled) >= 16:
                compiled.clear()
            template = compiled[source] = env.from_string(source)
        pieces, size = [], 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > max_output:
                return _reply(b"b")
            pieces.append(piece)
        return _reply(b"o", "".join(pieces))
    except MemoryError:
        return _reply(b"m")
    except Exception as exc:  # noqa: BLE001 - a template is someone else's program: any failure is a reply
        kind = b"s" if isinstance(exc, (SecurityError, TemplateSyntaxError)) else b"r"
        try:
            detail = " ".join(str(exc)[:DETAIL].split())
        except MemoryError:
            return _reply(b"m")
        except Exception:  # noqa: BLE001 - a message that cannot be made: its type says enough
            detail = ""
        return _reply(kind, f"{type(exc).__name__}\0{detail}")


_cpu_soft = [-1]  # the soft RLIMIT_CPU last set (setrlimit only when it moves: once per CPU second at most)


def _cpu_allowance(seconds: int) -> None:
    """RLIMIT_CPU's soft limit at the CPU time used so far plus `seconds` (the hard limit is left as it is)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(used.ru_utime + used.ru_stime) + 1 + seconds
    if soft == _cpu_soft[0]:
        return
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    _cpu_soft[0] = soft


def serve(argv: list) -> None:
    lifeline, memory = int(argv[1]), int(argv[2])
    sys.path[:0] = argv[3:]
    threading.stack_size(1 << 18)
    threading.Thread(target=_lifeline, args=(lifeline,), daemon=True).start()
    env = _environment()
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    compiled: dict = {}
    _write_all(1, b"ready")
    while True:
        try:
            size = int.from_bytes(_read_exact(0, 4), "big")
            source, context, jobs, max_output, cpu_seconds = pickle.loads(_read_exact(0, size))
        except EOFError:
            return
        _answer(env, compiled, source, context, jobs, max_output, cpu_seconds)
        del context, jobs


def _answer(env, compiled: dict, source: str, context: dict, jobs: list, max_output: int, cpu_seconds: int) -> None:
    """Render each job's renders with its tools and write the answers (the module docstring's protocol)."""
    pending, flushed = [], time.monotonic()
    for tools, renders in jobs:
        context["tools"] = tools
        last = b"o"
        for messages, add_generation_prompt in renders:  # a reply for each, until one is not a text
            if pending and time.monotonic() - flushed > FLUSH_SECONDS:  # the parent times each render
                _write_all(1, b"".join(pending))
                pending, flushed = [], time.monotonic()
            _cpu_allowance(cpu_seconds)
            context.update(messages=messages, add_generation_prompt=add_generation_prompt)
            pending.append(_render(env, compiled, source, context, max_output))
            last = pending[-1][:1]
            if last != b"o":
                break
        if last not in (b"o", b"r"):  # a refusal, memory or output past its bound: the request ends here
            break
    _write_all(1, b"".join(pending))


if __name__ == "__main__":
    serve(sys.argv)
