"""Rendering a model directory's chat template as the hostile input it may be: Jinja's immutable sandbox with a time
and an output budget, and one message (exit 2) for any failure.

A chat template ships with a model directory, so it is someone else's program. transformers already renders it in
`ImmutableSandboxedEnvironment`, but a template that reaches for Python internals ends in a SecurityError traceback,
and one that loops or grows its output without end hangs the process or fills its memory. Here:
- the same environment as transformers' (trim_blocks, lstrip_blocks, loopcontrols, `raise_exception`, `tojson`,
  `strftime_now`, `namespace` without underscore names, a `{% generation %}` block that just renders its body);
- memory: every operation that makes a text sizes it first, from its operands, and is refused past `MAX_OUTPUT`
  characters before anything is allocated: `*` `**` `+` `%` and `~`, str's `format`/`join`/`replace`/`expandtabs`/
  `translate`, printf and format-spec widths and precisions, the filters that outgrow their value by an argument
  (`indent`, `wordwrap`, `join`, `replace`, `format`, `tojson`'s indent, ...), a block's or macro's output; integer
  operands past `MAX_OUTPUT` (`'x' * n`, `s.center(n)`, `range(n)`) are refused as they are. A container costs its
  items only, but printing it builds their text every time one repeats, so every value a template makes (literals,
  call and filter results, namespace attributes, a call's arguments) has its text sized as it is made: no later
  str(), repr, JSON or error message can outgrow the budget by more than its escapes. A template holds as many such
  values at once as it has places for them (`{% set %}`s, a literal's items), so all a render builds, garbage
  included, counts against `MAX_BUILT`; the constants Jinja folds while compiling share one `MAX_OUTPUT`;
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
import re
import signal
import threading
import time
from collections.abc import ItemsView, KeysView, ValuesView
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache, update_wrapper, wraps
from itertools import chain
from typing import Any, Dict, Iterator, List, Optional

from dsrecipes.core.errors import UserError

MAX_OUTPUT = 1 << 20  # characters of a rendered prompt, of any text a template makes (and largest int operand)
MAX_BUILT = 32 * MAX_OUTPUT  # characters one render may build in all, garbage included (an item of a container: 32)
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


def _within(size: int, what: str) -> None:
    """Refuse what would build a text of `size` characters (an upper bound, computed first) past the budget."""
    if size > MAX_OUTPUT:
        raise _OverBudget(f"{what} would build up to {size} characters, past the budget of {MAX_OUTPUT}")


# -- The size of a text before it is built. `_text_size` is about len(str(value)); the others are upper bounds on
# what one operation makes from its operands, each from the operands' own sizes (counting, never building).


def _text_size(value: Any, indent: Optional[int] = None, separator: int = 2) -> int:
    """About len(str(value)), counted without building it, and no further than just past the budget: a string its
    characters (a nested one's repr or JSON may escape a few of them more), a container its items' text with
    `separator` characters after each one, and with `indent` (JSON's, pprint's) a line break and `indent` characters a
    level before each one. A container's items are references: one value many times over is counted every time,
    which is what printing it would build."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 2
    if isinstance(value, float) or value is None:
        return 24
    size, todo = 0, [iter((value,))]
    while todo:
        for item in todo[-1]:  # the innermost container's next items
            size += separator if indent is None else separator + 1 + (len(todo) - 1) * indent
            if isinstance(item, (str, bytes)):
                size += len(item) + 3
            elif isinstance(item, int):
                size += item.bit_length() // 3 + 2
            elif isinstance(item, float) or item is None:
                size += 24
            elif (flat := _flat_size(item)) is not None:
                size += 16 + flat + len(item) * (separator if indent is None else separator + 1 + len(todo) * indent)
            else:
                parts = _parts(item)
                size += 64 if parts is None else 16
                if parts is not None:
                    todo.append(parts)
                    break
            if size > MAX_OUTPUT:
                return size
        else:
            todo.pop()
    return size


def _flat_size(value: Any) -> Optional[int]:
    """The text of a long list's, tuple's or set's items when they are all strings or all integers (a split, a
    `range(n)|list`), summed in one pass of C; None for any other value."""
    if not isinstance(value, (list, tuple, set, frozenset)) or len(value) < 64:
        return None
    kinds = set(map(type, value))
    if kinds <= {str}:
        return sum(map(len, value)) + 3 * len(value)
    if kinds <= {int}:
        return sum(map(int.bit_length, value)) // 3 + 2 * len(value)
    return None


def _parts(value: Any) -> Optional[Iterator[Any]]:
    """The values str(value) shows (a dict's keys and values, a namespace's attributes), or None: a function, a
    loop, an undefined value show none."""
    if isinstance(value, dict):
        return chain.from_iterable(value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return iter(value)
    if isinstance(value, _namespace_type()):
        return chain.from_iterable(object.__getattribute__(value, "_Namespace__attrs").items())
    return iter(value) if isinstance(value, (KeysView, ValuesView, ItemsView)) else None


@lru_cache(maxsize=1)
def _namespace_type() -> type:
    from jinja2.utils import Namespace  # lazy: jinja2

    return Namespace


def _sized(value: Any) -> Any:
    """`value`, once its text is within the budget (whatever prints, formats or quotes it, an error message too,
    then stays within a few times the budget) and it is `_charge`d: every value a template builds passes here."""
    size = _text_size(value)
    if size > MAX_OUTPUT:
        _within(size, f"a {type(value).__name__}")
    _charge(_weight(value))
    return value


def _weight(value: Any) -> int:
    """What building `value` allocated, in characters: a text's length, 32 an item for a container (its reference
    and an object it may be the only one to hold, a number of `range(n)|list`), nothing for the rest."""
    if isinstance(value, (str, bytes)):
        return len(value)
    return 32 * len(value) if isinstance(value, (list, tuple, dict, set, frozenset)) else 0


def _counted(items: Any, between: int, what: str) -> Iterator[Any]:
    """`items` one at a time, refused once their text, with `between` characters between them, passes the budget:
    what consumes them whole before it allocates (str.join, sum) is refused first."""
    size = -between
    for item in items:
        size += _text_size(item) + between
        _within(size, what)
        yield item


def _digits(number: Optional[str]) -> int:
    """A width or precision as a format writes it (none: 0); one of 19 digits or more is past any budget."""
    if not number:
        return 0
    return int(number) if len(number) < 19 else 1 << 62


def _field_size(value: Any, width: int, precision: int) -> int:
    """At most the characters one formatted field (`%`, str.format) takes: its width, or its value's text; a
    number's digits grouped, padded to `precision`, a float's up to 310 before the point."""
    if isinstance(value, (int, float)):
        return max(width, precision + _text_size(value) * 4 // 3 + 320)
    return max(width, _text_size(value))


_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[_,]?(?:\.(\d*))?[a-zA-Z%]?", re.S)
_CONVERSION = re.compile(r"[-+ #0]*(\*|\d*)(?:\.(\*|\d*))?[hlL]?(.?)", re.S)


def _spec_size(value: Any, spec: str) -> int:
    """At most the characters format(value, spec) makes (a spec that is not the standard one is refused by format
    itself: no value in a template has its own)."""
    standard = _SPEC.fullmatch(spec)
    return _field_size(value, *(_digits(n) for n in standard.groups()) if standard else (0, 0))


def _printf_size(fmt: Any, values: Any) -> int:
    """At most the characters `fmt % values` makes: the format's own text, and for each conversion its width and
    precision (`*`: the next value) and value. A mapping key is read as Python reads it, parentheses nested."""
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    positional = iter(values if isinstance(values, tuple) else (values,))

    def number(written: str) -> int:
        taken = next(positional, 0) if written == "*" else _digits(written)
        return abs(taken) if isinstance(taken, int) else 0

    size, at = len(text), text.find("%")
    while at >= 0:
        at += 1
        keyed, value = text.startswith("(", at), None
        if keyed:
            depth, end = 1, at + 1
            while depth and end < len(text):
                depth += (text[end] == "(") - (text[end] == ")")
                end += 1
            try:
                value = values[text[at + 1:end - 1]]
            except Exception:  # not a mapping, or no such key: `%` itself says so
                pass
            at = end
        conversion = _CONVERSION.match(text, at)
        width, precision = number(conversion.group(1)), number(conversion.group(2))
        if not keyed and conversion.group(3) != "%":
            value = next(positional, None)
        size += _field_size(value, width, precision)
        at = text.find("%", conversion.end())
    return size


def _modulo_size(left: Any, right: Any) -> int:
    """`left % right`: a printf format when `left` is text (also the `format` filter, the `odd`, `even` and
    `divisibleby` tests), else a number."""
    return _printf_size(left, right) if isinstance(left, (str, bytes)) else 0


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """At most the text `left <operator> right` makes: `*` repeats a sequence, `+` puts two together, `%` formats."""
    if operator == "%":
        return _modulo_size(left, right)
    if operator == "+":
        return _text_size(left) + _text_size(right)
    if operator == "*":
        sized, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(count, int) and hasattr(sized, "__len__"):
            return _text_size(sized) * count
    return 0


def _replace_size(s: Any, old: Any, new: Any, count: Optional[int] = -1) -> int:
    """`s.replace(old, new, count)`, the `replace` filter (which takes the text of each)."""
    s, old, new = (x if isinstance(x, (str, bytes)) else str(x) for x in (s, old, new))
    found = s.count(old) if count is None or count < 0 else min(s.count(old), count)
    return len(s) + found * max(len(new) - len(old), 0)


def _expandtabs_size(s: Any, tabsize: int = 8) -> int:
    """str.expandtabs: each tab becomes at most `tabsize` spaces."""
    return len(s) + s.count(b"\t" if isinstance(s, bytes) else "\t") * max(tabsize - 1, 0)


def _translate_size(s: Any, table: Any, delete: Any = b"") -> int:
    """str.translate: each character becomes at most the longest text the table maps to (bytes: one byte)."""
    if isinstance(s, bytes):
        return len(s)
    values = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else (table,)
    return len(s) * max((_text_size(v) for v in values), default=1)


def _indent_size(s: Any, width: Any = 4, first: bool = False, blank: bool = False) -> int:
    """The `indent` filter: `width` (spaces, or a string) before each line."""
    lines = len(s.splitlines()) + 1 if isinstance(s, str) else 1
    return _text_size(s) + 1 + lines * (len(width) if isinstance(width, str) else max(width, 0))


def _wordwrap_size(s: Any, width: int = 79, break_long_words: bool = True, wrapstring: Optional[str] = None,
                   break_on_hyphens: bool = True) -> int:
    """The `wordwrap` filter: `wrapstring` at each break. Two lines in a row hold more than `width` characters of
    `s` (the second would have fit on the first), so a paragraph breaks fewer than 2 * len / width times."""
    text = s if isinstance(s, str) else ""
    breaks = 2 * len(text) // max(width, 1) + len(text.splitlines()) + 1
    return len(text) + breaks * len("\n" if wrapstring is None else wrapstring)


def _urlize_size(value: Any, trim_url_limit: Optional[int] = None, nofollow: bool = False, target: Any = None,
                 rel: Any = None, extra_schemes: Any = None) -> int:
    """The `urlize` filter: each word may become a link, its text twice (escaped), `target` and `rel` around it."""
    text = str(value)
    return 10 * len(text) + (len(text.split()) + 1) * (64 + _text_size(target) + _text_size(rel))


def _json_size(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> int:
    """The `tojson` filter: JSON's text, its separators and its indent (spaces, or a string, a level) on each item."""
    level = None if indent is None else len(indent) if isinstance(indent, str) else max(indent, 0)
    return _text_size(x, indent=level, separator=2 if separators is None else sum(map(len, separators)))


def _lipsum_size(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> int:  # noqa: A002 (lipsum's names)
    """`lipsum`: `n` paragraphs of at most `max` words (of at most 12 letters), punctuated, tagged."""
    return n * (max + 1) * 16


# What this thread may still build. `building`: a render's values are each within the budget, but a template holds
# as many at once as it has places for them (`{% set %}`s, a literal's items, a call's arguments), so all it builds,
# garbage included, counts against MAX_BUILT. `folding`: while a template compiles, Jinja runs the filters and tests
# whose arguments are constants and joins their results into the code unchecked (`~`, adjacent output): past
# MAX_OUTPUT characters they fail, which Jinja takes as "not constant", and run when rendering, on the budget.
_allowance = threading.local()


def _charge(size: int) -> None:
    """Count `size` characters built against this thread's render (none outside one)."""
    left = getattr(_allowance, "building", None)
    if left is not None:
        _allowance.building = left - size
        if left < size:
            raise _OverBudget(f"it built more than {MAX_BUILT} characters in all (each value within the budget)")


class _SizedFields:
    """A string.Formatter (mixed into Jinja's sandboxed ones) that sizes each field before formatting it, and adds
    it to the result's size so far: the format's own text, then each field, within the budget."""

    _size = 0

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._size = len(format_string)
        return super().vformat(format_string, args, kwargs)  # type: ignore[misc]

    def format_field(self, value: Any, format_spec: str) -> Any:
        self._size += _spec_size(value, format_spec)
        _within(self._size, "str.format")
        return super().format_field(value, format_spec)  # type: ignore[misc]


def _bounded(fn: Any, name: str, size: Any = None, counted: Any = None) -> Any:
    """Filter, test or global `fn` within the budget: its integer arguments (`center(n)`, `indent(n)`) at most the
    budget; `size`, given its arguments, is the text it would build, checked before it runs; `counted`, given its
    arguments, the characters between the items of a value it consumes whole (join, sum), which are counted as it
    goes; its result is `_sized`, and while compiling it is charged to the template's folding budget."""
    from jinja2.utils import _PassArg  # lazy: jinja2

    passes, label = _PassArg.from_obj(fn) is not None, f"`{name}`"

    @wraps(fn)  # keeps Jinja's pass_context / pass_eval_context marks: Jinja calls it as it calls `fn`
    def bounded(*args: Any, **kwargs: Any) -> Any:
        lead, given = (args[:1], args[1:]) if passes else ((), args)  # without the context Jinja passes first
        _refuse_big_ints(*given, *kwargs.values())
        if size is not None:
            _within(size(*given, **kwargs), label)
        if counted is not None and given:
            between = counted(*given, **kwargs)
            if between is not None:
                given = (_counted(given[0], between, label), *given[1:])
        result = _sized(fn(*lead, *given, **kwargs))
        folding = getattr(_allowance, "folding", None)
        if folding is not None:
            _allowance.folding = folding - _text_size(result)
            _within(MAX_OUTPUT - _allowance.folding, "constants folded while compiling")
        return result

    return bounded


# Filters that build a text larger than their value's by an argument (`size`), or consume their value whole, into a
# text or a list (`counted`); every other filter's result is within a small multiple of its value's text, and is
# `_sized`.
_FILTER_SIZES = {
    "batch": lambda value, linecount, fill_with=None: 0 if fill_with is None else linecount * _text_size(fill_with),
    "format": lambda value, *args, **kwargs: _modulo_size(value if isinstance(value, str) else str(value),
                                                          kwargs or args),
    "indent": _indent_size,
    "pprint": lambda value: _text_size(value, indent=1),
    "replace": _replace_size,
    "tojson": _json_size,
    "urlize": _urlize_size,
    "wordwrap": _wordwrap_size,
}
_FILTER_COUNTED = {
    "join": lambda value, d="", attribute=None: _text_size(d),
    "sum": lambda iterable, attribute=None, start=0: None if isinstance(start, (int, float)) else 0,
    **dict.fromkeys(("groupby", "list", "slice", "sort", "unique"), lambda *args, **kwargs: 4),  # into a list: ", ''"
}
_TEST_SIZES = {
    "divisibleby": _modulo_size,
    "even": lambda value: _modulo_size(value, 2),
    "odd": lambda value: _modulo_size(value, 2),
}
# The methods of str and bytes whose result outgrows their text by an argument (str.join is `_counted`; center,
# ljust, rjust, zfill by an integer, which is within the budget; format and format_map use `_SizedFields`).
_METHOD_SIZES = {"replace": _replace_size, "expandtabs": _expandtabs_size, "translate": _translate_size}


class _Budgeted:
    """The size checks of the sandbox's environment (`_bounded_class`), before Jinja's own behaviour (super())."""

    def _generate(self, *args: Any, **kwargs: Any) -> str:
        """Compiling, with `_allowance.folding` for the constants Jinja folds."""
        _allowance.folding = MAX_OUTPUT
        try:
            return super()._generate(*args, **kwargs)
        finally:
            _allowance.folding = None

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator in ("*", "**"):
            _refuse_big_ints(left, right)
        if operator == "**" and isinstance(right, int) and abs(right) > 64:
            raise _OverBudget(f"an exponent of {right}")
        size = _binop_size(operator, left, right)
        if size > MAX_OUTPUT:
            _within(size, f"`{operator}`")
        result = super().call_binop(context, operator, left, right)
        _charge(_weight(result))
        return result

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        """What a call receives it may keep (a macro's `varargs`, a cycler's items), so its arguments together
        are within the budget; str's and bytes' methods that outgrow their text are sized first."""
        _refuse_big_ints(*args, *kwargs.values())
        given = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}  # not Jinja's own
        _within(sum(map(_text_size, args)) + sum(map(_text_size, given.values())), "a call's arguments")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes)):
            name = getattr(__obj, "__name__", None)
            if name == "join" and len(args) == 1:
                args = (_counted(args[0], len(owner), "str.join"),)
            elif name in _METHOD_SIZES:
                _within(_METHOD_SIZES[name](owner, *args, **given), f"str.{name}")
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def concat(self, pieces: Any) -> str:
        """A block's, a macro's, a `{% set %}` block's output, joined once it is within the budget."""
        pieces = pieces if isinstance(pieces, list) else list(pieces)
        size = sum(map(len, pieces))
        _within(size, "a block")
        _charge(size)
        return "".join(pieces)

    @staticmethod
    def sized(value: Any) -> Any:
        """A container the template writes out (`Generator`)."""
        return _sized(value)

    @staticmethod
    def joins(operands: tuple) -> tuple:
        """The operands of `a ~ b ~ ...`, once their text together is within the budget (`Generator`)."""
        size = sum(map(_text_size, operands))
        _within(size, "`~`")
        _charge(size)
        return operands


def _generator_class() -> type:
    """Jinja's code generator with the size checks (used by `_bounded_class`)."""
    from jinja2.compiler import CodeGenerator, optimizeconst

    class Generator(CodeGenerator):
        """Jinja's code generator, with the containers a template writes (`[a, b]`, `(a, b)`, `{k: v}`) `_sized`
        as they are made, and `a ~ b` joining its operands only once their text together is within the budget."""

        def visit_List(self, node: Any, frame: Any) -> None:
            self.write("environment.sized(")
            super().visit_List(node, frame)
            self.write(")")

        def visit_Dict(self, node: Any, frame: Any) -> None:
            self.write("environment.sized(")
            super().visit_Dict(node, frame)
            self.write(")")

        def visit_Tuple(self, node: Any, frame: Any) -> None:
            if node.ctx != "load":  # a target: `{% for a, b in ... %}`
                return super().visit_Tuple(node, frame)
            self.write("environment.sized(")
            super().visit_Tuple(node, frame)
            self.write(")")

        @optimizeconst
        def visit_Concat(self, node: Any, frame: Any) -> None:  # Jinja's, its operands passed through `joins`
            if frame.eval_ctx.volatile:
                func_name = "(markup_join if context.eval_ctx.volatile else str_join)"
            elif frame.eval_ctx.autoescape:
                func_name = "markup_join"
            else:
                func_name = "str_join"
            self.write(f"{func_name}(environment.joins((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write(")))")

    return Generator


def _bounded_class() -> type:
    """Jinja's immutable sandbox with every size-building operation checked first (module docstring)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter

    Generator = _generator_class()

    class Formatter(_SizedFields, SandboxedFormatter):
        pass

    class EscapeFormatter(_SizedFields, SandboxedEscapeFormatter):
        pass

    class Bounded(_Budgeted, ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def wrap_str_format(self, value: Any) -> Any:
            """Jinja's str.format / format_map wrapper, with a formatter that sizes each field first."""
            if super().wrap_str_format(value) is None:
                return None
            text = value.__self__
            formatter = EscapeFormatter(self, escape=text.escape) if hasattr(text, "__html__") else Formatter(self)
            if value.__name__ == "format_map":
                def formatted(mapping: Any, /) -> str:
                    return type(text)(formatter.vformat(text, (), mapping))
            else:
                def formatted(*args: Any, **kwargs: Any) -> str:
                    return type(text)(formatter.vformat(text, args, kwargs))
            return update_wrapper(formatted, value)

    return Bounded


@lru_cache(maxsize=1)
def _environment() -> Any:
    """The sandbox every template compiles in, made once."""
    import jinja2
    import jinja2.ext

    Bounded = _bounded_class()

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
            attrs = object.__getattribute__(self, "_Namespace__attrs")
            _within(sum(map(_text_size, chain.from_iterable(attrs.items()))), "a namespace")

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded(f, name, _FILTER_SIZES.get(name), _FILTER_COUNTED.get(name))
                   for name, f in env.filters.items()}
    env.tests = {name: _bounded(f, name, _TEST_SIZES.get(name)) for name, f in env.tests.items()}
    env.globals.update(raise_exception=raise_exception, namespace=Namespace, lipsum=_bounded(
        env.globals["lipsum"], "lipsum", _lipsum_size), strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    return _environment().from_string(source)


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
            _allowance.building = MAX_BUILT
            try:
                for piece in template.generate(**context):
                    size += len(piece)
                    if size > MAX_OUTPUT:
                        raise _OverBudget(f"its output passed {MAX_OUTPUT} characters")
                    pieces.append(piece)
            finally:
                _allowance.building = None
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
