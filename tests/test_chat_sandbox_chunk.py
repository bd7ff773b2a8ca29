"""A chunk of conversations renders in one exchange with the chat-template sandbox (dsrecipes/boundary/chat_sandbox.py
`render_chunk`): training's throughput on a model's own template stays near rendering in process (per-conversation
round trips cost ~35%, benchmarks/bench_chat_sandbox.py). Each conversation's texts are what `render_many` gives it
alone; the conversation the template declines is that row's problem only; a template the sandbox refuses is still
the whole chunk's one message."""

from __future__ import annotations

import pytest

from dsrecipes.boundary import chat_sandbox
from dsrecipes.boundary.chat_sandbox import TemplateRaised, TemplateRefused, render_chunk, render_many

ROW = ("{% for m in messages %}{% if 'DECLINE' in m['content'] %}{{ raise_exception('no ' + m['content']) }}{% endif %}"
       "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
       "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n"
       "{% endif %}")


class Tokenizer:
    name_or_path = "chunk-model"
    special_tokens_map: dict = {}

    def __init__(self, chat_template: str):
        self.chat_template = chat_template


@pytest.fixture
def round_trips(monkeypatch):
    calls = []
    real = chat_sandbox._RENDERER.render

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(chat_sandbox._RENDERER, "render", counted)
    return calls


def conversation(i: int, text: str = "hi"):
    user = {"role": "user", "content": f"{text} {i}"}
    reply = {"role": "assistant", "content": f"answer {i}"}
    return [([user, reply], False), ([user], True)], ([{"name": f"tool{i}"}] if i % 3 == 0 else None)


def test_a_chunk_is_one_round_trip_and_each_conversation_renders_as_alone(round_trips):
    tok = Tokenizer(ROW)
    jobs = [conversation(i, "DECLINE" if i == 5 else "hi") for i in range(24)]
    got = render_chunk(tok, jobs)
    assert len(round_trips) == 1
    assert isinstance(got[5], TemplateRaised) and "no DECLINE 5" in got[5].detail
    for i, (renders, tools) in enumerate(jobs):
        if i != 5:
            assert got[i] == render_many(tok, renders, tools), i
    assert "tools: " in got[0][0] and "tools: " not in got[1][0]  # each conversation its own tools


def test_a_refused_template_is_the_whole_chunks_message_and_the_renderer_goes_on():
    tok = Tokenizer("{% if 'BAD' in messages[0]['content'] %}{{ ''.__class__.__mro__ }}{% endif %}" + ROW)
    jobs = [conversation(i, "BAD" if i == 3 else "hi") for i in range(6)]
    with pytest.raises(TemplateRefused, match="chunk-model: chat_template: chat template refused") as err:
        render_chunk(tok, jobs)
    assert not isinstance(err.value, TemplateRaised)
    assert render_chunk(tok, jobs[:2]) == [render_many(tok, *job) for job in jobs[:2]]  # the child answers again


def test_requests_are_bounded(monkeypatch, round_trips):
    monkeypatch.setattr(chat_sandbox, "REQUEST_RENDERS", 4)
    tok = Tokenizer(ROW)
    jobs = [conversation(i) for i in range(9)]  # 2 renders each: 2 conversations a request
    assert render_chunk(tok, jobs) == [render_many(tok, *job) for job in jobs]
    assert len(round_trips) == 5 + 9


def test_training_encodes_a_batch_in_one_round_trip_and_a_declined_row_is_its_bad_row(round_trips):
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.paths import TINY_TOKENIZER_DIR
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.render.tokenize import Encoder
    from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

    cfg = compose_and_load(["debug=fast", "template=tokenizer", f"model.path={TINY_TOKENIZER_DIR}"])
    tok = load_tokenizer(cfg)
    tok.chat_template = ROW
    encoder = Encoder(tok, cfg)
    convs = [Conversation(f"c{i}", [Turn(Role.user, f"{'DECLINE' if i == 7 else 'q'} {i}"), Turn(Role.assistant, "a"),
                                    Turn(Role.user, "more"), Turn(Role.assistant, f"b {i}")]) for i in range(24)]
    alone = [encoder.encode_batch([c], errors=[]) for c in convs]
    round_trips.clear()
    batch = encoder.encode_arrays(convs)
    assert len(round_trips) == 1
    assert [i for i, _ in batch.bad] == [7] and "no DECLINE 7" in str(batch.bad[0][1])
    examples = encoder.encode_batch(convs, errors=[])
    assert [e and (e.input_ids, e.labels) for e in examples] == [a[0] and (a[0].input_ids, a[0].labels) for a in alone]
