"""Memory bombs in a chat template (chat_sandbox.py): whatever builds the text - an operator (`~`, `%`, `*`, `+`), a
str method, a format spec's width or precision, a filter or test, a block's or macro's output, the constants Jinja
folds while compiling, the str(), JSON or error message of a value that repeats one large string, or many values
each of moderate size - the template runs in the renderer child process under its address-space limit (MAX_MEMORY),
its time limits and MAX_OUTPUT, and is refused with one message ("chat template stopped" / "refused") while this
process's traced memory stays where it was (a few KiB for the request and the reply). Before the child process, each
case was refused by sizing every operation on Jinja's internals; a few cases that sizing refused on an upper bound
but that Python builds small (`indent` of blank lines, `urlize` of words that are no links), or that stay within
the child's limits (a 10 MB `~`, 100 lists), are scaled here to what would really take the memory.
(Loops, Python internals: test_trust.py; the OS limits themselves: test_chat_sandbox_os.py.)"""

from __future__ import annotations

import json
import tracemalloc

import pytest

from dsrecipes.boundary.chat_sandbox import MAX_OUTPUT, TemplateRaised, TemplateRefused, render

S = "{% set s = 'x' * 1000000 %}"  # one string within the budget, repeated below
MANY = "range(300)|map(attribute='x', default=s)"  # 300 references to it, one at a time
HOSTILE = {
    "`~` doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(28) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                     "{{ ns.s|length }}"),
    "`~` of many operands": S + "{{ (" + " ~ ".join(["s"] * 300) + ")|length }}",
    "`%` width": "{{ '%0400000000d' % 1 }}",
    "`%` width taken from the values": "{{ '%*d' % (400000000, 1) }}",
    "`%` keyed, nested parentheses": "{{ '%(a(b)c)400000000s' % {'a(b)c': 1} }}",
    "`%` precision": "{{ '%.400000000f' % 1.0 }}",
    "`format` filter": "{{ '%0400000000d'|format(1) }}",
    "`odd` test": "{{ '%0400000000d' is odd }}",
    "`divisibleby` test": "{{ '%0400000000d' is divisibleby(3) }}",
    "str.format width": "{{ '{:>400000000}'.format('x') }}",
    "str.format nested width": "{{ '{:>{}}'.format('x', '400000000') }}",
    "str.format precision": "{{ '{:.400000000f}'.format(1.0) }}",
    "str.format_map width": "{{ '{x:>400000000}'.format_map({'x': 1}) }}",
    "str.format repeating a field": S + "{{ ('{0}' * 300).format(s) }}",
    "`tojson` indent": "{{ messages|tojson(indent=100000000) }}",
    "`tojson` separators": S + "{{ range(300)|list|tojson(separators=(s, ':')) }}",
    "`join` filter": S + "{{ " + MANY + "|join }}",
    "str.join": S + "{{ ''.join(" + MANY + ") }}",
    "`replace` filter": S + "{{ ('x' * 300)|replace('x', s) }}",
    "str.replace": S + "{{ ('x' * 300).replace('x', s) }}",
    "str.expandtabs": "{{ ('\\t' * 1000000).expandtabs(300) }}",
    "str.translate": S + "{{ ('x' * 300).translate({120: s}) }}",
    "`indent` filter": "{{ ('x\\n' * 100000)|indent(3000) }}",
    "`wordwrap` filter": "{{ ('a ' * 100000)|wordwrap(1, wrapstring='y' * 3000) }}",
    "`urlize` filter": "{{ ('www.a.com ' * 30000)|urlize(target='y' * 10000) }}",
    "`batch` filter's fill": S + "{{ [1]|batch(300, s)|list }}",
    "`sum` of lists": ("{% set l = range(100000)|list %}"
                       "{{ (range(100)|map(attribute='x', default=l)|sum(start=[]))|length }}"),
    "`lipsum`": "{{ lipsum(100000, max=1000)|length }}",
    "`list` of a long text": "{{ ('中' * 10000000)|list|length }}",
    "a block's output": S + "{% set b %}{% for i in range(300) %}{{ s }}{% endfor %}{% endset %}{{ b|length }}",
    "a macro's output": S + "{% macro m() %}{% for i in range(300) %}{{ s }}{% endfor %}{% endmacro %}{{ m()|length }}",
    "constants folded while compiling": "{{ 'x'|center(1000000) }}" * 60,
    "an autoescape expression folded while compiling": ("{% autoescape " + " ~ ".join(["'x'|center(1000000)"] * 300)
                                                         + " %}{% endautoescape %}"),
    "a list printed": S + "{{ [s] * 300 }}",
    "nested literals printed": S + ("{% set a = [s, s, s] %}{% set b = [a, a, a] %}{% set c = [b, b, b] %}"
                                    "{% set d = [c, c, c] %}{% set e = [d, d, d] %}{{ e }}"),
    "a dict printed": S + "{{ {}.fromkeys(range(300), s) }}",
    "a namespace printed": (S + "{% set ns = namespace() %}" + "".join(f"{{% set ns.a{i} = s %}}" for i in range(100))
                            + "{{ ns }}"),
    "a cycler's items printed": S + "{{ cycler(*(" + MANY + ")).items }}",
    "a macro's varargs printed": S + "{% macro m() %}{{ varargs }}{% endmacro %}{{ m(*(" + MANY + ")) }}",
    "an error message quoting a value": S + "{{ [0].index([s] * 300) }}",
    "many values, each within the budget": "".join(f"{{% set v{i} = 'x'|center(1000000) %}}" for i in range(100)),
    "many lists, each within the budget": "".join(f"{{% set v{i} = (range(256)|list) * 250 %}}" for i in range(600)),
    "an undefined name quoting a value": S + "{% set t = (" + "s, " * 300 + ") %}{{ {}[t].x }}",
}
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


class Tokenizer:
    name_or_path = "hostile-model"
    special_tokens_map: dict = {}

    def __init__(self, chat_template: str):
        self.chat_template = chat_template


def traced_render(template: str):
    """render()'s outcome (its text, or the TemplateRefused it raised) and the peak of traced memory meanwhile."""
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        outcome = render(Tokenizer(template), MESSAGES)
    except TemplateRefused as exc:
        outcome = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1] - base
        if not tracing:
            tracemalloc.stop()
    return outcome, peak


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_memory_bomb_is_stopped_in_the_child_and_this_process_allocates_nothing(name):
    outcome, peak = traced_render(HOSTILE[name])
    assert isinstance(outcome, TemplateRefused) and not isinstance(outcome, TemplateRaised), outcome
    message = str(outcome)
    assert message.count("hostile-model: chat_template: chat template stopped:") == 1, message
    assert peak < 2**20, f"{peak / 2**20:.1f} MiB traced in this process"  # the child built it, not this process


SIZED = {  # each operation above, within the limits: what Python itself makes, byte for byte
    "{{ '%0500000d' % 7 }}": "%0500000d" % 7,
    "{{ '%*d|%.3f|%-4s|' % (6, 7, 2.5, 'ab') ~ '%(a)s=%(b)05d' % {'a': 'k', 'b': 3} }}": "     7|2.500|ab  |k=00003",
    "{{ '{:>500000}|{:.2f}|{:,}'.format('x', 3.14159, 1234) }}": "{:>500000}|{:.2f}|{:,}".format("x", 3.14159, 1234),
    "{{ '{0}{0}'.format('y' * 500000) }}": "y" * 1000000,
    "{{ messages|tojson(indent=4) }}": json.dumps(MESSAGES, ensure_ascii=False, indent=4),
    "{{ ('a\\nb\\n' * 1000)|indent(100) }}": ("a\nb\n" * 1000).replace("\n", "\n" + " " * 100).rstrip(" "),
    "{{ ('a b ' * 1000)|wordwrap(3, wrapstring='|') }}": "|".join(["a b"] * 1000),
    "{{ ('x' * 1000)|replace('x', 'yy') }}": "yy" * 1000,
    "{{ ('\\t' * 1000).expandtabs(500) }}": " " * 500000,
    "{{ ', '.join(range(3)|map('string')) ~ '|' ~ range(3)|join('-') }}": "0, 1, 2|0-1-2",
    "{{ ('x' * 1000).translate({120: 'ab'}) }}": "ab" * 1000,
    "{% set ns = namespace(s='ab') %}{% for i in range(18) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}":
        "ab" * 2**18,
    "{{ [[1, 2]]|sum(start=[]) }}{{ range(4)|batch(3, 0)|list }}": "[1, 2][[0, 1, 2], [3, 0, 0]]",
}


@pytest.mark.parametrize("template", list(SIZED))
def test_the_same_operations_within_the_limits_render_as_python_makes_them(template):
    outcome, _ = traced_render(template)
    assert outcome == SIZED[template]
    assert len(outcome) <= MAX_OUTPUT
