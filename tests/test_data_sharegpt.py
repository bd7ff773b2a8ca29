"""Reading sources, normalisation, sample ids, the bad-row policy and registries (dsrecipes.data.sources.sharegpt/registry)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrecipes.core.errors import ConfigError, DataError
from dsrecipes.core.schema import BadRows, ColumnsConfig, DatasetConfig, DatasetFormat, SourceConfig
from dsrecipes.data.sources.badrows import BadReason, BadRow, BadRowReport
from dsrecipes.data.sources.files import read_rows
from dsrecipes.data.sources.registry import load_registry, resolve_sources
from dsrecipes.data.sources.sharegpt import Role, iter_conversations, iter_source, normalize_row

FIX = Path(__file__).parent / "fixtures" / "data"

EXPECTED_BAD = {  # line of bad_rows.jsonl -> reason
    2: "invalid_json", 3: "not_an_object", 4: "missing_conversation", 5: "conversation_not_list",
    6: "empty_conversation", 7: "turn_not_object", 8: "unknown_role", 9: "bad_value", 10: "bad_value",
    11: "no_assistant_turn", 13: "system_not_first", 14: "invalid_utf8", 17: "bad_value",
}


def source(*paths: str, **kw) -> SourceConfig:
    return SourceConfig(name=kw.pop("name", "test"), paths=[str(FIX / p) for p in paths], **kw)


def read_all(src: SourceConfig, policy=BadRows.skip, quarantine=None, max_bad=1.0):
    report = BadRowReport(policy, max_bad, quarantine)
    return list(iter_source(src, report)), report


def test_every_malformed_kind_is_counted_and_quarantined(tmp_path):
    q = tmp_path / "quarantine.jsonl"
    convs, report = read_all(source("bad_rows.jsonl"), quarantine=q)
    report.close()
    assert [c.loc for c in convs] == [1, 12, 15]
    expected = {}
    for reason in EXPECTED_BAD.values():
        expected[reason] = expected.get(reason, 0) + 1
    assert dict(report.counts) == expected
    assert report.rows_read == 16 and report.skipped == len(EXPECTED_BAD)
    assert report.trailing_turns_dropped == 1
    entries = [json.loads(line) for line in q.read_text(encoding="utf-8").splitlines()]
    assert {e["line"]: e["reason"] for e in entries} == EXPECTED_BAD
    by_line = {e["line"]: e for e in entries}
    assert by_line[2]["raw"].startswith('{"conversations"')  # the unparsable text itself
    assert by_line[8]["raw"]["conversations"][0]["from"] == "alien"  # the parsed row
    assert "\ufffd" in by_line[14]["raw"]  # undecodable bytes shown, replaced
    assert all(e["file"].endswith("bad_rows.jsonl") for e in entries)


@pytest.mark.parametrize("policy", [BadRows.error])
def test_error_policy_stops_at_first_bad_row_with_file_and_line(policy):
    with pytest.raises(DataError) as err:
        read_all(source("bad_rows.jsonl"), policy=policy)
    (msg,) = err.value.problems
    assert msg.startswith(str(FIX / "bad_rows.jsonl") + ":2: invalid_json")
    assert "\n" not in msg and "dataset.bad_rows=skip" in msg


def test_max_bad_fraction(tmp_path):
    _, report = read_all(source("bad_rows.jsonl"), max_bad=0.5)
    with pytest.raises(DataError, match=r"13 of 16 rows are bad \(81.2% > dataset.max_bad_fraction=0.5\)"):
        report.check()
    _, report = read_all(source("bad_rows.jsonl"), max_bad=0.9)
    report.check()


def test_sample_ids_row_field_else_file_and_line():
    convs, _ = read_all(source("bad_rows.jsonl"))
    assert [c.id for c in convs] == ["ok-1", "bad_rows.jsonl:12", "bad_rows.jsonl:15"]
    convs, report = read_all(source("array.json"))
    assert [c.id for c in convs] == ["array.json:0", "array.json:1"]  # JSON arrays: 0-based index
    assert dict(report.counts) == {"not_an_object": 1}
    convs, _ = read_all(source("alpaca.json", format=DatasetFormat.alpaca))
    assert convs[0].id == "7"


def test_normalisation_system_tools_and_trailing_turns():
    convs, _ = read_all(source("array.json"))
    first, tool = convs
    assert first.system == "Be brief." and [t.role for t in first.turns] == [Role.user, Role.assistant]
    assert [t.role for t in tool.turns] == [Role.user, Role.tool_call, Role.observation, Role.assistant]
    assert tool.tools.startswith('[{"name": "get_weather"')
    convs, _ = read_all(source("bad_rows.jsonl"))
    assert convs[1].dropped_turns == 1 and convs[1].turns[-1].content == "hello"
    # system field and leading system turn combine; "[]" tools (Glaive's 'no tools') is no tools
    raw = {"system": "A", "tools": "[]", "conversations": [
        {"from": "system", "value": "B"}, {"from": "USER ", "value": "q"}, {"from": "bot", "value": "a"}]}
    conv = normalize_row(raw, "x", SourceConfig())
    assert conv.system == "A\n\nB" and conv.tools is None and conv.turns[0].role is Role.user


def test_role_aliases_can_be_extended_and_are_checked():
    raw = {"conversations": [{"from": "customer", "value": "q"}, {"from": "agent", "value": "a"}]}
    with pytest.raises(BadRow) as bad:
        normalize_row(raw, "x", SourceConfig())
    assert bad.value.reason is BadReason.unknown_role and "customer" in bad.value.detail
    conv = normalize_row(raw, "x", SourceConfig(roles={"customer": "user", "agent": "assistant"}))
    assert [t.role for t in conv.turns] == [Role.user, Role.assistant]
    with pytest.raises(ConfigError, match="roles.agent: 'boss' is not a role"):
        normalize_row(raw, "x", SourceConfig(roles={"agent": "boss"}))


def test_openai_format_parts_tool_calls_and_tool_role():
    cols = ColumnsConfig(messages="messages", role="role", content="content")
    convs, report = read_all(source("openai.jsonl", format=DatasetFormat.openai, columns=cols))
    assert report.skipped == 0
    assert convs[0].system == "You are terse."
    roles = [t.role for t in convs[1].turns]
    assert roles == [Role.user, Role.tool_call, Role.observation, Role.assistant]
    assert convs[1].turns[0].content == "add 1 and 2"
    assert json.loads(convs[1].turns[1].content) == {"name": "add", "arguments": {"a": 1, "b": 2}}


def test_alpaca_input_history_and_missing_output():
    convs, report = read_all(source("alpaca.json", format=DatasetFormat.alpaca))
    assert convs[0].turns[0].content == "Translate to French\ncat" and convs[0].turns[1].content == "chat"
    assert [t.content for t in convs[1].turns] == ["first?", "yes", "Say hi", "hi"]
    assert dict(report.counts) == {"missing_field": 1}


def test_a_row_of_another_format_names_the_dataset_that_reads_it(tmp_path):
    """An alpaca file (or openai messages) read as ShareGPT: every row 'missing_conversation', now with the fix."""
    (tmp_path / "a.jsonl").write_text('{"instruction": "2+2?", "input": "", "output": "4"}\n'
                                      '{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "x"}\n')
    with pytest.raises(DataError, match=r"a.jsonl:1: missing_conversation .*; an alpaca row: read such files with "
                                        r"dataset=alpaca \(or dataset.format=alpaca\)"):
        read_all(SourceConfig(name="s", paths=[str(tmp_path / "a.jsonl")]), policy=BadRows.error)
    report = BadRowReport(BadRows.skip, 1.0, tmp_path / "q.jsonl")
    assert list(iter_source(SourceConfig(name="s", paths=[str(tmp_path / "a.jsonl")]), report)) == []
    report.close()
    reasons = [json.loads(line)["detail"] for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert "dataset=openai_messages" in reasons[1], reasons
    assert reasons[2] == ("no 'conversations' field (keys: ['text']); a 'text' row (TRL's language modeling) is no "
                          "conversation: make each text one assistant turn"), reasons
    (tmp_path / "b.jsonl").write_text('{"conversations": [{"role": "user", "content": "hi"}]}\n'
                                      '{"conversations": [{"speaker": "user", "text": "hi"}]}\n')
    report = BadRowReport(BadRows.skip, 1.0, tmp_path / "q2.jsonl")
    assert list(iter_source(SourceConfig(name="s", paths=[str(tmp_path / "b.jsonl")]), report)) == []
    report.close()
    reasons = [json.loads(line)["detail"] for line in (tmp_path / "q2.jsonl").read_text().splitlines()]
    assert reasons[0] == "turn 0: no 'from' key (keys: ['content', 'role']); role/content messages: " \
        "dataset=openai_messages (or dataset.columns.role=role dataset.columns.content=content)", reasons
    assert reasons[1] == "turn 0: no 'from' key (keys: ['speaker', 'text'])", reasons
    msgs = SourceConfig(name="s", paths=[str(tmp_path / "b.jsonl")], format=DatasetFormat.openai)
    msgs.columns.messages = "messages"
    with pytest.raises(DataError, match="ShareGPT rows under 'conversations': dataset=sharegpt_files"):
        read_all(msgs, policy=BadRows.error)
    (tmp_path / "b.jsonl").write_text('{"prompt": [{"role": "user", "content": "hi"}], "completion": []}\n')
    with pytest.raises(DataError, match=r"bad_value \('prompt'/'completion': list/list, not two strings \(TRL "
                                        r"standard\) or two message lists \(the completion non-empty\)\)"):
        read_all(msgs, policy=BadRows.error)  # an empty completion: read as TRL's row, nothing to train


def test_gz_empty_file_and_unmatched_glob(tmp_path):
    convs, report = read_all(source("small.jsonl.gz"))
    assert len(convs) == 4 and convs[2].id == "small.jsonl.gz:3"
    convs, report = read_all(source("empty.jsonl", "nothing-*.jsonl"))
    assert convs == [] and dict(report.counts) == {"empty_file": 1, "no_matching_path": 1}
    (tmp_path / "lines.json").write_text('{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}\n' * 2)
    rows = list(read_rows(str(tmp_path / "lines.json")))  # JSON lines in a .json file
    assert [r.loc for r in rows] == [1, 2] and all(r.error is None for r in rows)
    with pytest.raises(DataError, match="empty.jsonl: empty_file"):
        read_all(source("empty.jsonl"), policy=BadRows.error)


def test_caps_stop_reading_early():
    ds = DatasetConfig(paths=[str(FIX / "small.jsonl.gz")], sources=[source("array.json", name="arr")], max_samples=5)
    report = BadRowReport(BadRows.skip, 1.0)
    convs = list(iter_conversations(ds, report=report))
    assert [c.source for c in convs] == ["sample"] * 4 + ["arr"] and report.rows_read == 5
    convs, report = read_all(source("small.jsonl.gz", max_samples=2))
    assert len(convs) == 2 and report.rows_read == 2


def test_llamafactory_registry():
    with pytest.raises(ConfigError, match="remote: only local `file_name` entries are supported"):
        load_registry(str(FIX / "dataset_info.json"))
    info = json.loads((FIX / "dataset_info.json").read_text())
    from dsrecipes.data.sources import registry as reg

    sharegpt = reg._llamafactory_entry("toy_sharegpt", info["toy_sharegpt"], str(FIX))
    convs, report = read_all(sharegpt)
    assert report.skipped == 0 and convs[0].system == "Be nice."
    assert [t.role for t in convs[0].turns] == [Role.user, Role.assistant]
    alpaca = reg._llamafactory_entry("toy_alpaca", info["toy_alpaca"], str(FIX))
    assert alpaca.format is DatasetFormat.alpaca


def test_registry_use_mixes_entries_after_paths(tmp_path):
    info = json.loads((FIX / "dataset_info.json").read_text())  # its hub entry `remote` is not used: no matter
    info.update({f"hub_{i}": {"hf_hub_url": f"org/set_{i}"} for i in range(30)})  # as LLaMA-Factory's own file
    for name in ("custom_roles.jsonl", "alpaca.json"):
        (tmp_path / name).write_bytes((FIX / name).read_bytes())
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    ds = DatasetConfig(name="main", paths=[str(FIX / "small.jsonl.gz")], registry=str(tmp_path / "dataset_info.json"),
                       use=["toy_sharegpt", "toy_alpaca"])
    assert [s.name for s in resolve_sources(ds)] == ["main", "toy_sharegpt", "toy_alpaca"]
    report = BadRowReport(BadRows.skip, 1.0)
    convs = list(iter_conversations(ds, report=report))
    assert [c.source for c in convs] == ["main"] * 4 + ["toy_sharegpt"] * 2 + ["toy_alpaca"] * 2
    with pytest.raises(ConfigError, match=r"dataset.use: 'nope' is not in .* \(entries: hub_0, hub_1, .*, "
                                          r"\.\.\. \(33 in all\)\)$"):
        resolve_sources(DatasetConfig(registry=str(tmp_path / "dataset_info.json"), use=["nope"]))
    with pytest.raises(ConfigError, match=r"dataset.registry.hub_3: only local `file_name` entries are supported "
                                          r"\(has hf_hub_url: its files are read as dataset.paths=\[hf://datasets/org/set_3/FILE\]"):
        resolve_sources(DatasetConfig(registry=str(tmp_path / "dataset_info.json"), use=["hub_3"]))


def test_yaml_registry():
    entries = load_registry(str(FIX / "registry.yaml"))
    assert entries["gz_math"].weight == 2.0 and entries["gz_math"].paths == [str(FIX / "small.jsonl.gz")]
    convs, report = read_all(entries["openai_chat"])
    assert len(convs) == 2 and report.skipped == 0


def test_yaml_registry_typos_are_errors(tmp_path):
    (tmp_path / "r.yaml").write_text("x:\n  paths: [a.jsonl]\n  wieght: 2\n")
    with pytest.raises(ConfigError, match="dataset.registry.x.wieght: unknown key"):
        load_registry(str(tmp_path / "r.yaml"))


def test_glaive_files_read_cleanly(glaive):
    for name in ("glaive_toolcall_en_demo.json.gz", "glaive_toolcall_zh_demo.json.gz"):
        convs, report = read_all(SourceConfig(name="g", paths=[str(glaive / name)]), policy=BadRows.error)
        assert len(convs) == 300 and report.rows_read == 300
        roles = {t.role for c in convs for t in c.turns}
        assert roles == {Role.user, Role.assistant, Role.tool_call, Role.observation}
        assert sum(c.tools is not None for c in convs) > 100


def test_empty_reply_is_kept_not_dropped():
    raw = {"conversations": [{"from": "human", "value": "say nothing"}, {"from": "gpt", "value": ""}]}
    conv = normalize_row(raw, "x", SourceConfig())
    assert [(t.role, t.content) for t in conv.turns] == [(Role.user, "say nothing"), (Role.assistant, "")]
