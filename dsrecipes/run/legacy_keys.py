"""Settings added after runs existed, and what a run started before each one trained as (its legacy value).

A run's config.yaml holds every setting of the version that wrote it; a key added later is absent there, and that
run trained as the code then behaved, which is one value of the new key (objective.loss_average: micro_batches,
objective.lr_scale: 1.0). `LEGACY` lists them. The resume contract reads an absent key as its legacy value
(`as_started`), so a run resumed with that value shows no difference, and a differing one is named with what the run
trained as and the override that resumes it (`describe`, `remedy`).

The launching process continues such a run with its legacy values (`continue_as_started`, called by run/entry.py
decide before the data is identified, and said in one line): for these keys the legacy value is the only safe
continuation (each falls under the contract's must-match keys, and the checkpoint's weights, optimizer state and data
position were made under it), so the same command resumes the run as it was. Only a value the user names on the
command line for such a key stays theirs, and is refused (exit 2) by the contract like any other must-match change.
A run that continued that way holds the legacy value in its config.yaml; a saved value equal to the legacy one is
continued the same way, so the next resume with the same command goes on too.

A new key that must match on resume needs a row here (tests/test_resume_contract.py checks it against the keys of
runs that already existed); keys a resume may change (launcher timeouts, ...) need none.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

from dsrecipes.config.defaults import learning_rate
from dsrecipes.config.load import from_dict
from dsrecipes.core.schema import TrainConfig
from dsrecipes.core.typed import config_to_dict

Value = Union[Any, Callable[[Dict[str, Any]], Any]]  # a value as config.yaml holds it, or one of the saved config


def _kind(saved: Dict[str, Any]) -> Any:
    objective = saved.get("objective")
    return objective.get("kind", "sft") if isinstance(objective, dict) else "sft"


def _rows_of(saved: Dict[str, Any]) -> str:
    """Before `objective.rows` an objective's kind chose its rows: sft read conversations, dpo and orpo pairs."""
    return "conversation" if _kind(saved) == "sft" else "pair"


def _loss_average_of(saved: Dict[str, Any]) -> str:
    """sft and grpo averaged each micro-batch's loss over its own tokens (micro_batches); dpo, orpo and reward do not
    read the key (a pair's loss), so the new default is theirs as well."""
    return "micro_batches" if _kind(saved) in ("sft", "grpo") else "tokens"


def _mix_sample_of(saved: Dict[str, Any]) -> bool:
    """Named data (dataset.use / dataset.sources) was read together with the bundled sample's dataset.paths; without
    named data the key changes nothing (false, the default)."""
    dataset = saved.get("dataset")
    return isinstance(dataset, dict) and bool(dataset.get("use") or dataset.get("sources"))


@dataclass(frozen=True)
class Legacy:
    key: str  # a dotted schema key; "dataset.sources[].share": that key of every entry of the list
    value: Value  # what a run started before the key existed trained as
    added: str  # the commit that added the key


# The grpo and reward keys (objective=grpo and objective=reward came with them): the objectives that existed before
# do not read them, so their schema defaults, which those objectives' option files keep, are what those runs had.
LEGACY: Tuple[Legacy, ...] = (
    Legacy("objective.loss_average", _loss_average_of, "edec4ea"),
    Legacy("objective.lr_scale", 1.0, "632a8da"),  # the model's rate unscaled (optimizer.lr: `_rederive_lr`)
    Legacy("objective.rows", _rows_of, "af0157b"),
    Legacy("dataset.mix_sample", _mix_sample_of, "8fe4865"),
    Legacy("dataset.split.shares", {}, "19dc1a7"),  # no split: every row
    Legacy("dataset.split.take", None, "19dc1a7"),
    Legacy("dataset.split.pin", {}, "19dc1a7"),
    Legacy("dataset.sources[].share", None, "19dc1a7"),
    Legacy("template.train_eot_newline", False, "bed46b4"),  # the text after the end-of-turn token untrained
    Legacy("dataset.pairs_as", "refuse", "02931d7"),  # sft refused a pair row (a bad row)
    Legacy("dataset.sources[].pairs_as", None, "02931d7"),  # the dataset's
    Legacy("objective.center_rewards_coefficient", None, "6ea4e92"),
    *(Legacy(f"objective.{key}", value, "930ee91") for key, value in (
        ("num_generations", 4), ("max_completion_length", 64), ("temperature", 1.0), ("epsilon", 0.2),
        ("rewards", []), ("reward_model", None), ("reward_model_weight", 1.0))),
)


def _get(data: Dict[str, Any], dotted: str, absent: Any = None) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return absent
        data = data[part]
    return data


def _set(data: Dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[last] = value


def legacy_value(row: Legacy, saved: Dict[str, Any]) -> Any:
    return row.value(saved) if callable(row.value) else row.value


def as_started(saved: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the saved config with every absent legacy key filled in with its legacy value, {key: legacy value} of those
    filled). A list entry's key is filled in each entry (`dataset.sources[].share`)."""
    out, filled = copy.deepcopy(saved), {}
    for row in LEGACY:
        value = legacy_value(row, saved)
        if "[]." in row.key:
            where, key = row.key.split("[].", 1)
            for entry in _get(out, where) or []:
                if isinstance(entry, dict) and key not in entry:
                    entry[key] = value
                    filled[row.key] = value
        elif _get(out, row.key, _ABSENT) is _ABSENT and isinstance(_get(out, row.key.rsplit(".", 1)[0], {}), dict):
            _set(out, row.key, value)
            filled[row.key] = value
    return out, filled


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def filled_row(key: str, filled: Dict[str, Any]) -> Optional[str]:
    """The filled legacy key a flattened key of the compared configs falls under (itself, a dict's leaf below it, a
    list entry's key in that list), else None."""
    for row in filled:
        base = row.split("[].", 1)[0]
        if key == base or key.startswith(base + "."):
            return row
    return None


def describe(key: str, row: str, filled: Dict[str, Any], now: Any) -> str:
    """`objective.loss_average: absent (this run started before the key existed and trained as micro_batches) ->
    tokens`."""
    return (f"{key}: absent (this run started before the key existed and trained as {plain(filled[row])}) -> "
            f"{plain(now)}")


def remedy(rows: Sequence[str], filled: Dict[str, Any], explicit: Set[str]) -> str:
    """The line that says how to resume with the legacy values, naming the overrides."""
    words = [f"{row}={plain(filled[row])}" for row in dict.fromkeys(rows) if "[]." not in row]
    if not words:
        return ""
    mine = [w for w in words if named(w.split("=", 1)[0], explicit)]
    verb = "use" if mine else "add"
    tail = " in place of your own" if mine else ""
    return f"To resume it as it started, {verb}: {' '.join(words)}{tail}"


def plain(value: Any) -> str:
    """A value as an override writes it: `tokens`, `true`, `1.0`, `{}` (a long one cut at 80 characters)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def explicit_keys(overrides: Sequence[str]) -> Set[str]:
    """The dotted keys the command line sets (`a.b=1`, `+a.b=1`, `++a.b=1`); `objective=dpo` chooses an option file
    and names no key."""
    keys = {ov.split("=", 1)[0].lstrip("+~") for ov in overrides if "=" in ov}
    return {k for k in keys if "." in k}


def named(key: str, explicit: Set[str]) -> bool:
    return any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in explicit)


def continue_as_started(cfg: TrainConfig, saved: Dict[str, Any],
                        overrides: Sequence[str]) -> Tuple[TrainConfig, List[str]]:
    """(the config that continues the run saved as `saved` (its config.yaml): every legacy key the saved config lacks,
    or holds at its legacy value, set to that value where this command would use another and does not name the key
    (`overrides`); the `key=value` settings changed). A differing value the command names is left for the contract
    to refuse."""
    explicit = explicit_keys(overrides)
    new = config_to_dict(cfg)
    changed: List[str] = []
    for row in LEGACY:
        if "[]." in row.key or named(row.key, explicit):
            continue
        value = legacy_value(row, saved)
        stored = _get(saved, row.key, _ABSENT)
        if stored is not _ABSENT and stored != value or _get(new, row.key, _ABSENT) == value:
            continue
        _set(new, row.key, value)
        changed.append(f"{row.key}={plain(value)}")
    if not changed:
        return cfg, []
    out, errors = from_dict(new)
    if out is None or errors:  # a legacy value the schema refuses: a wrong row (tests check every row's key)
        raise ValueError(f"legacy values do not fit the schema: {errors}")
    out, note = _rederive_lr(cfg, out, saved, explicit)
    return out, changed + note


def _rederive_lr(cfg: TrainConfig, out: TrainConfig, saved: Dict[str, Any],
                 explicit: Set[str]) -> Tuple[TrainConfig, List[str]]:
    """optimizer.lr derived from the old objective.lr_scale (config/defaults.learning_rate) derived again from the
    legacy one, when the saved run trained at exactly that rate (an optimizer.lr the user or a recipe set stays)."""
    if out.objective.lr_scale == cfg.objective.lr_scale or named("optimizer.lr", explicit):
        return out, []
    unset = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, lr=None))
    legacy = learning_rate(dataclasses.replace(out, optimizer=dataclasses.replace(out.optimizer, lr=None)))
    if cfg.optimizer.lr != learning_rate(unset) or _get(saved, "optimizer.lr") != legacy:
        return out, []
    return dataclasses.replace(out, optimizer=dataclasses.replace(out.optimizer, lr=legacy)), [
        f"optimizer.lr={legacy:g} (the rate it trained at; with the new objective.lr_scale {cfg.objective.lr_scale:g} "
        f"this command would derive {cfg.optimizer.lr:g})"]
