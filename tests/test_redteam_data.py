"""Red-team cases for data in: hostile registries and rows, each one message (never a traceback) or trained as
served."""

from __future__ import annotations

import json

import pytest

from dsrecipes.core.errors import ConfigError
from dsrecipes.data.sources.registry import load_registry

TAGS = {"role_tag": "speaker", "content_tag": "text", "user_tag": "client", "assistant_tag": "agent"}


@pytest.mark.parametrize("extra,message", [
    ({"columns": ["dialog"]}, "dataset.registry.x.columns: expected a mapping of names to strings, got list"),
    ({"tags": "speaker"}, "dataset.registry.x.tags: expected a mapping of names to strings, got str"),
    ({"tags": {**TAGS, "user_tag": {"a": 1}}}, "dataset.registry.x.tags.user_tag: expected a non-empty string"),
    ({"columns": {"messages": 5}}, "dataset.registry.x.columns.messages: expected a non-empty string, got 5"),
    ({"num_samples": "abc"}, "dataset.registry.x.num_samples: must be a whole number >= 1, got 'abc'"),
    ({"num_samples": 1e400}, "dataset.registry.x.num_samples: must be a whole number >= 1, got inf"),
    ({"num_samples": -3}, "dataset.registry.x.num_samples: must be a whole number >= 1, got -3"),
    ({"ranking": "false"}, "dataset.registry.x.ranking: must be true or false, got 'false'"),
    ({"tags": {**TAGS, "user_tag": "agent"}}, "dataset.registry.x.tags: user_tag and assistant_tag are both 'agent'"),
])
def test_a_dataset_info_entry_with_odd_columns_tags_or_counts_is_one_message(tmp_path, extra, message):
    """Was: a list for `columns`/`tags` or a dict as a tag was an AttributeError/TypeError traceback, num_samples
    'abc' or 1e400 a ValueError/OverflowError traceback; -3, a number as a column and two roles with one tag value
    (the later silently won: every such turn one role) were accepted."""
    entry = {"file_name": "rows.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialog"}, "tags": TAGS}
    registry = tmp_path / "dataset_info.json"
    registry.write_text(json.dumps({"x": {**entry, **extra}}), encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_registry(str(registry), ["x"])
    assert message in str(err.value)


def test_a_plain_dataset_info_entry_still_reads(tmp_path):
    entry = {"file_name": "rows.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialog"}, "tags": TAGS,
             "num_samples": 5, "ranking": None}
    registry = tmp_path / "dataset_info.json"
    registry.write_text(json.dumps({"x": entry}), encoding="utf-8")
    src = load_registry(str(registry), ["x"])["x"]
    assert src.max_samples == 5 and not src.ranking
    assert src.roles["client"] == "user" and src.roles["agent"] == "assistant"
