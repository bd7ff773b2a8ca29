"""What each row kind is (owner: data/): `ROW_KINDS[RowKind]`, the one table every layer of `data/` looks a kind up in.

A row kind (`objective.rows`: conversation, pair, prompt; declared by the objective) is read, checked, scanned,
sharded and loaded by the parts named in its `RowKindSpec`:
- `reader`: the `samples.SampleKind` reading one row of a kind that is one sample around a prompt (pairs, prompts);
  empty for conversations, which `sharegpt.parse_item` reads;
- `encoder`: renders and tokenizes rows, `encoder(tokenizer, cfg).encode_batch` (the checks of training);
- `checked`: `checked(cfg, report, encoder, sources)` -> (row read, encoded) of every row of sources read through
  files.py that passes those checks (`dsrecipes shard`, presharded parts checked anew);
- `checker`: the stream pre-scan's per-file checks (scan_files.RowChecker's contract; given the reader first);
- `loader`: raw lines -> rows inside a loader worker (strategies; given the reader and the encoder first);
- `canonical`: the row as `dsrecipes shard` writes it (samples.canonical_row's layout), `row_format` the manifest's
  name for such parts and `what` what they hold, in messages; `tokens` the encoded columns counted as a row's
  tokens in a run;
- `sources`: which source formats hold it and whether they are ranking data (preference.check_sources);
- `settings`: the config values besides the template, tokenizer and `data.cutoff_len/packing/train_on` a row's checks
  depend on (cache and scan keys), and `keyed`: whether scan keys name the kind (conversation keys predate kinds).
The map preparation of each kind is `prepare/build.py` `PREPARATIONS` (tests/test_row_kinds.py checks both).

Parts are named `module:attribute` and imported on use: this module imports nothing of `data/`, so whatever only
asks for a row format or a kind's sources (`dsrecipes shard`'s start, `validate`) loads no encoder (numpy), and the
modules it names may look their kind up here without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from importlib import import_module
from operator import attrgetter
from typing import Any, Callable, Dict, Optional, Tuple

from dsrecipes.core.schema import DatasetFormat, RowKind

SAMPLES = (DatasetFormat.sharegpt, DatasetFormat.openai)  # the formats rows around a prompt are read in


def resolved(name: str) -> Any:
    """`module:attribute` -> the attribute (the module imported now, once)."""
    module, _, attribute = name.partition(":")
    return getattr(import_module(module), attribute)


@dataclass(frozen=True)
class RowSources:
    """Which sources hold a row kind."""

    ranking: bool  # ranking (chosen/rejected) data: a registry entry with `ranking: true`
    formats: Tuple[DatasetFormat, ...]  # the source formats it is read in


@dataclass(frozen=True)
class RowKindSpec:
    """One row kind, for every layer of the data layer (module docstring: what each part is)."""

    what: str
    row_format: str
    sources: RowSources
    reader: str
    encoder: str
    checked: str
    checker: str
    loader: str
    canonical: str
    tokens: Tuple[str, ...]
    settings: Tuple[Tuple[str, str], ...] = ()  # (key in the cache material, dotted config path)
    keyed: bool = True

    def sample_kind(self) -> Optional[Any]:
        """The kind's `SampleKind`, or None for conversations."""
        return resolved(self.reader) if self.reader else None

    def encoding(self, tokenizer: Any, cfg: Any) -> Any:
        """What renders and tokenizes this kind's rows for the checks of training."""
        return resolved(self.encoder)(tokenizer, cfg)

    def checker_factory(self) -> Callable[..., Any]:
        """`checker(name, source, element, limit, encoder)`: the pre-scan's checks of one file."""
        return self._bound(self.checker)

    def loader_factory(self) -> Callable[..., Any]:
        """`loader(cfg, tokenizer, paths, sources, element_files)`: raw lines -> rows in a loader worker."""
        return self._bound(self.loader, resolved(self.encoder))

    def check_settings(self, cfg: Any) -> Dict[str, Any]:
        """{cache-material key: value} of the settings a row's checks depend on besides the common ones."""
        return {key: attrgetter(path)(cfg) for key, path in self.settings}

    def where(self, item: Any) -> Any:
        """The Conversation of a checked item (`checked`'s first): where it was read."""
        return item.prompt if self.reader else item

    def token_count(self, encoded: Any) -> int:
        """Tokens of an encoded row in a run (an SFT Example, None when nothing trained is left, or a row dict)."""
        if encoded is None:
            return 0
        columns = encoded if isinstance(encoded, dict) else vars(encoded)
        return sum(len(columns[key]) for key in self.tokens)

    def _bound(self, name: str, *more: Any) -> Callable[..., Any]:
        made = resolved(name)
        return partial(made, resolved(self.reader), *more) if self.reader else made


_RENDER, _SOURCES = "dsrecipes.data.render", "dsrecipes.data.sources"
_SAMPLE_CHECKER = "dsrecipes.data.stream.scan_samples:SampleChecker"
_SAMPLE_LOADER = "dsrecipes.data.strategies.sample_rows:SampleRowEncoder"

ROW_KINDS: Dict[RowKind, RowKindSpec] = {  # one per row kind (tests/test_row_kinds.py)
    RowKind.conversation: RowKindSpec(
        "conversations (SFT rows)", "dsrecipes-sharegpt-v1", RowSources(False, tuple(DatasetFormat)),
        reader="", encoder=f"{_RENDER}.tokenize:Encoder", checked="dsrecipes.data.stream.scan:checked_conversations",
        checker="dsrecipes.data.stream.scan_files:RowChecker", loader="dsrecipes.data.strategies.rows:RowEncoder",
        canonical=f"{_SOURCES}.samples:canonical_row", tokens=("input_ids",), keyed=False),
    RowKind.pair: RowKindSpec(
        "preference pairs", "dsrecipes-pairs-v1", RowSources(True, SAMPLES),
        reader=f"{_SOURCES}.preference:PAIRS", encoder=f"{_RENDER}.preference_encode:PairEncoder",
        checked=f"{_RENDER}.preference_encode:checked_pairs", checker=_SAMPLE_CHECKER, loader=_SAMPLE_LOADER,
        canonical=f"{_SOURCES}.preference:pair_row", tokens=("prompt_ids", "chosen_ids", "rejected_ids")),
    RowKind.prompt: RowKindSpec(
        "prompts", "dsrecipes-prompts-v1", RowSources(False, SAMPLES),
        reader=f"{_SOURCES}.prompts:PROMPTS", encoder=f"{_RENDER}.prompt_encode:PromptEncoder",
        checked=f"{_RENDER}.prompt_encode:checked_prompts", checker=_SAMPLE_CHECKER, loader=_SAMPLE_LOADER,
        canonical=f"{_SOURCES}.prompts:prompt_row", tokens=("prompt_ids",),
        settings=(("completion", "objective.max_completion_length"),)),  # the budget: cutoff_len - completion
}
