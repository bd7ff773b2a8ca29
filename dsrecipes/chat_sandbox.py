"""Rendering a model directory's chat template as the hostile input it may be: Jinja's immutable sandbox with a time
and an output budget, and one message (exit 2) for any failure.

A chat template ships with a model directory, so it is someone else's program. transformers already renders it in
`ImmutableSandboxedEnvironment`, but a template that reaches for Python internals ends in a SecurityError traceback,
and one that loops or grows its output without end hangs the process or fills its memory. Here:
- the same environment as transformers' (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `tojson`,
  `strftime_now`, `namespace` without underscore names, a `{% generation %}` block that just renders its body);
- operators and calls whose integer operands could build something huge (`'x' * n`, `2 ** n`, `s.center(n)`,
  `range(n)`, the `center`/`indent` filters) are refused past `MAX_OUTPUT`, and no operator, call or filter may
  return a string or list longer than that;
- rendering streams (`Template.generate`) and stops past `MAX_OUTPUT` characters;
- a wall-clock budget (`MAX_SECONDS`) stops a template that loops without output: SIGALRM in a main thread (the
  launching process, a data-preparation worker process), an exception raised into the thread by a watchdog elsewhere.
Every failure is `TemplateRefused` (a UserError) naming the model directory. `TemplateRaised`, its subclass, is the
template declining this conversation (its `raise_exception`, an undefined key, a type error): training calls that a
bad row. Past a budget or reaching for Python internals (SecurityError) is never a row's fault.
This module is the only place a model-supplied template is rendered (chat, prompt-eval, training, validate).
"""

from __future__ import annotations

import ctypes
import json
import signal
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any, Dict, Iterator, List, Optional

from dsrecipes.errors import UserError

MAX_OUTPUT = 1 << 20  # characters of a rendered prompt (also the largest integer operand of *, **, calls)
MAX_SECONDS = 2.0


class TemplateRefused(UserError):
    pass


class TemplateRaised(TemplateRefused):
    """The template declined this conversation; `detail` is its own message."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail

    def __reduce__(self) -> Any:  # crosses from a data-preparation worker process
        return (type(self), (str(self), self.detail))


class _OverBudget(Exception):
    pass


class _Expired(_OverBudget):
    """Raised into a non-main thread by the watchdog (an exception class: no arguments)."""

    def __init__(self, *args: Any):
        super().__init__(*(args or (f"it ran longer than {MAX_SECONDS:g} s",)))


def _refuse_big_ints(*values: Any) -> None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_OUTPUT:
            raise _OverBudget(f"an operand of {v} is past the budget of {MAX_OUTPUT}")


def _sized(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple)) and len(value) > MAX_OUTPUT:
        raise _OverBudget(f"a value of {len(value)} items is past the budget of {MAX_OUTPUT}")
    return value


def _bounded(fn: Any) -> Any:
    """A Jinja filter whose integer arguments (`center(n)`, `indent(n)`, `wordwrap(n)`) stay within the budget."""
    @wraps(fn)  # keeps Jinja's pass_context / pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _refuse_big_ints(*args, *kwargs.values())
        return _sized(fn(*args, **kwargs))

    return bounded


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator in ("*", "**"):
                _refuse_big_ints(left, right)
                sized, count = (left, right) if isinstance(right, int) else (right, left)
                if operator == "*" and isinstance(count, int) and hasattr(sized, "__len__"):
                    _refuse_big_ints(len(sized) * count)
                if operator == "**" and isinstance(right, int) and abs(right) > 64:
                    raise _OverBudget(f"an exponent of {right}")
            return _sized(super().call_binop(context, operator, left, right))

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _refuse_big_ints(*args, *kwargs.values())
            return _sized(super().call(__context, __obj, *args, **kwargs))

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    class Namespace(jinja2.utils.Namespace):
        def __setitem__(self, name: str, value: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}")
            super().__setitem__(name, value)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters = {name: _bounded(f) for name, f in env.filters.items()}
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, namespace=Namespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise _OverBudget in this thread after `seconds`."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        with _watchdog(seconds):
            yield
        return

    def expire(_signum: int, _frame: Any) -> None:
        raise _OverBudget(f"it ran longer than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def _watchdog(seconds: float) -> Iterator[None]:
    """SIGALRM only reaches a main thread: elsewhere a timer thread raises _Expired into this one (the template is
    Python bytecode, so the interpreter delivers it at the loop's next jump); a late shot is withdrawn."""
    target = ctypes.c_ulong(threading.get_ident())
    lock = threading.Lock()
    done = [False]

    def fire() -> None:
        with lock:
            if not done[0]:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(target, ctypes.py_object(_Expired))

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            done[0] = True
        timer.cancel()


def template_source(tokenizer: Any) -> Optional[str]:
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        own = own.get("default")
    return own if isinstance(own, str) else None


def render(tokenizer: Any, messages: List[Dict[str, Any]], tools: Optional[list] = None,
           add_generation_prompt: bool = False, where: Any = None) -> str:
    """The tokenizer's chat template applied to `messages`, within the budgets; TemplateRefused otherwise."""
    where = where or f"{getattr(tokenizer, 'name_or_path', None) or 'the model'}: chat_template"
    source = template_source(tokenizer)
    if source is None:
        raise TemplateRefused(f"{where}: the tokenizer has no chat_template, so prompts cannot be rendered")
    context = dict(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                   **{k: v for k, v in getattr(tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)})
    pieces: List[str] = []
    size = 0
    started = time.monotonic()
    try:
        with _deadline(MAX_SECONDS):
            template = _compile(source)
            for piece in template.generate(**context):
                size += len(piece)
                if size > MAX_OUTPUT:
                    raise _OverBudget(f"its output passed {MAX_OUTPUT} characters")
                pieces.append(piece)
    except _OverBudget as exc:
        raise TemplateRefused(f"{where}: chat template stopped: {exc} ({time.monotonic() - started:.1f} s); "
                              "dsrecipes renders a model's template with a time and output budget")
    except Exception as exc:  # a template is someone else's program: any failure is one message
        import jinja2

        if isinstance(exc, (jinja2.exceptions.SecurityError, jinja2.exceptions.TemplateSyntaxError, MemoryError)):
            raise TemplateRefused(f"{where}: chat template refused: {type(exc).__name__}: {exc}; dsrecipes renders "
                                  "a model's template in a sandbox") from None
        detail = " ".join(str(exc).split())
        raise TemplateRaised(f"{where}: the chat template cannot render this conversation "
                             f"({type(exc).__name__}: {detail})", detail) from None
    return "".join(pieces)
