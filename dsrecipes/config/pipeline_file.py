"""A pipeline file (`dsrecipes pipeline FILE`): stages run in order, each one a normal training run.

    # SFT, then a reward model and DPO, both from the SFT export (DeepSpeed-Chat's steps 1-3)
    shared:                        # settings of every stage: a flat recipe (group choices and dotted keys)
      model: smollm2_135m
      model.lora.enabled: true
    prompts: {limit: 4, max_new_tokens: 32}   # optional: base and each stage answer 4 held-out prompts at the end
    stages:
      - name: sft
        recipe: smollm2_cpu_sft    # optional: a shipped recipe, or a recipe file (relative to this file)
        set:                       # this stage's settings, as in a flat recipe
          trainer.max_steps: 40
      - name: dpo
        model_from: sft            # model.path = that stage's export
        set: {objective: dpo, dataset: sample_pairs}
      # an RL stage takes a reward model from an earlier stage the same way, by key:
      #   from_export: {objective.reward_model: reward}   (any path setting: KEY = that stage's export)

A pipeline file is a recipe, read by the same bounded reader (config/recipe_file.py: size, UTF-8, YAML, aliases),
then checked here as typed data, every problem with its `file:line` and all of them at once: only the keys above
(positive lists, at the top and in a stage); a stage name is a plain name used once (it names the stage's run
directory); `model_from` and `from_export` name EARLIER stages; a setting's key is a key of the schema (or a config group), never
one starting with `_` (Hydra's `_target_` would name code) and never one the pipeline sets itself
(`trainer.output_dir`, `hydra.*`, `model.path` under `model_from`), nor one a shared recipe may not set
(SHARED_NEVER: tracking server, written directories, hosts, a batch job's activate script); a value is a number, true/false, null, a string
of the characters in VALUE_CHARS (letters, digits, spaces and `_.,:/@+=~%*?-`, plus `${resolver:arg}`), or a list
or mapping of those: no quotes, `;`, `|`, `&`, `$(`, backquotes or newlines, so no value can be read as more than
one override or as a command. Settings become command-line overrides of `train` (`stage_overrides`), which then
checks them like any other (config/safety.py, config/validate.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import yaml

import dsrecipes.config.recipe_file as recipe_file
from dsrecipes.config.field_classes import FIELDS, FieldClass
from dsrecipes.config.groups import RECIPE_GROUP, group_options
from dsrecipes.config.hints import schema_keys
from dsrecipes.config.safety import OUTSIDE_OPTIONS
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.suggest import closest, phrase

TOP_KEYS = ("shared", "stages", "prompts")
PROMPT_KEYS = {"limit": 64, "max_new_tokens": 1024}  # key -> the largest value (each answer costs generation)
STAGE_KEYS = ("name", "recipe", "set", "model_from", "from_export")
PIPELINE_SET = ("trainer.output_dir", "hydra")  # what the pipeline itself sets for every stage
# A pipeline file is shared like a recipe, but its settings reach `train` as command-line overrides (the user's own,
# to config/safety.py): so the keys a shared recipe may never set (config/field_classes.py) are refused here.
SHARED_NEVER = {
    FieldClass.user_named: "names a place outside the run directory or this machine (a tracking server that receives "
                           "your credentials, a directory written to, hosts); a pipeline file is shared like a recipe, "
                           "so only your environment or config tree may name it (MLFLOW_TRACKING_URI, $DSRECIPES_HOME)",
    FieldClass.command_line: "chooses code the batch job runs (an activate script, modulefiles): this machine's "
                             "setting, never a pipeline file's",
}
VALUE_CHARS = r"[\w .,:/@+=~%*?\-]"
_VALUE = re.compile(rf"(?:{VALUE_CHARS}|\$\{{[\w.:/\-]*\}})*\Z")
_KEY_PART = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_PLAIN = re.compile(r"[A-Za-z_/.][\w/\-+.@]*\Z")  # read by Hydra as this very string, unquoted
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_\-]{0,63}\Z")
MAX_STAGES = 32


def outside_by_hand(key: str) -> str:
    """What a pipeline says of an option naming a host outside this machine (config/safety.OUTSIDE_OPTIONS): only a
    command line may name one, and a pipeline takes no overrides (run/pipeline.outside_options says it too)."""
    return (f"names a host outside this machine, so only your command line may name it, and a pipeline takes no "
            f"overrides: run this stage with `dsrecipes train` and give {key}=[...] on its command line")


@dataclass
class Setting:
    key: str  # dotted
    value: Any
    line: int


@dataclass
class Stage:
    name: str
    line: int
    recipe: Optional[str] = None  # a shipped recipe's name, or an absolute recipe file path
    model_from: Optional[str] = None
    settings: List[Setting] = field(default_factory=list)
    from_export: Dict[str, str] = field(default_factory=dict)  # key -> earlier stage whose export path it takes

    def exports_used(self) -> Dict[str, str]:
        """{key: stage} of every setting taken from an earlier stage's export (`model_from` is model.path)."""
        return {**({"model.path": self.model_from} if self.model_from else {}), **self.from_export}


@dataclass
class Prompts:
    """`prompts:` the base model and each generating stage answer `limit` held-out prompts at the end."""

    limit: int = 4
    max_new_tokens: int = 32


@dataclass
class Pipeline:
    path: Path
    stages: List[Stage]
    shared: List[Setting] = field(default_factory=list)
    prompts: Optional[Prompts] = None

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def load_pipeline(path: Path) -> Pipeline:
    """The typed pipeline of `path`, or one ConfigError listing every problem with its file:line."""
    path = Path(path)
    text = recipe_file.read(path)
    recipe_file.parse(path, text)  # YAML, aliases and size within bounds, a mapping at the top
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    reader = _Reader(path)
    pipeline = reader.pipeline(root)
    if reader.errors:
        raise ConfigError(sorted(reader.errors, key=lambda e: int(e[len(str(path)) + 1:].partition(":")[0])))
    return pipeline


def stage_overrides(pipeline: Pipeline, stage: Stage) -> List[str]:
    """The `train` overrides of a stage: its recipe, the shared settings, then its own (later ones win)."""
    out = [f"{RECIPE_GROUP}={stage.recipe}"] if stage.recipe else []
    return out + [override(s.key, s.value) for s in pipeline.shared + stage.settings]


def override(key: str, value: Any) -> str:
    """One setting as a Hydra override: a group's option plain, a key of the schema `key=value`, a mapping or a key
    below a mapping of the schema (`dataset.split.shares.sft`) with `++` (Hydra adds it)."""
    if key in _groups():
        return f"{key}={value}"
    prefix = "" if key in _schema() and not isinstance(value, dict) else "++"  # Hydra merges into a mapping
    return f"{prefix}{key}={literal(value)}"


def literal(value: Any) -> str:
    """A checked value in Hydra's override grammar (strings quoted; VALUE_CHARS holds no quote or backslash)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{literal(v)}" for k, v in value.items()) + "}"
    plain = _PLAIN.match(value) and value.lower() not in ("true", "false", "null", "none", "inf", "nan")
    return value if plain else f"'{value}'"


def _groups() -> Dict[str, List[str]]:
    return {g: o for g, o in group_options().items() if g != RECIPE_GROUP}


def _schema() -> List[str]:
    return schema_keys()


class _Reader:
    """The checks of the opening comment, collecting every problem with its line."""

    def __init__(self, path: Path):
        self.path = path
        self.errors: List[str] = []
        self.groups = _groups()
        self.keys = set(_schema())

    def error(self, node: Any, what: str) -> None:
        line = node.start_mark.line + 1 if node is not None else 1  # None: an empty file
        self.errors.append(f"{self.path}:{line}: {what}")

    def pipeline(self, root: Any) -> Pipeline:
        items = self.mapping(root, TOP_KEYS, "the file")
        stages_node = items.get("stages")
        if stages_node is None:
            self.error(root, "stages: missing (a list of stages, each with a name)")
            return Pipeline(self.path, [])
        shared = self.settings(items["shared"], "shared", ()) if "shared" in items else []
        stages: List[Stage] = []
        if not isinstance(stages_node, yaml.SequenceNode) or not stages_node.value:
            self.error(stages_node, "stages: a non-empty list of stages")
        elif len(stages_node.value) > MAX_STAGES:
            self.error(stages_node, f"stages: at most {MAX_STAGES} stages")
        else:
            for i, node in enumerate(stages_node.value):
                stages.append(self.stage(node, i, stages))
        prompts = self.prompts(items["prompts"]) if "prompts" in items else None
        return Pipeline(self.path, stages, shared, prompts)

    def prompts(self, node: Any) -> Prompts:
        out = Prompts()
        for key, v in self.mapping(node, tuple(PROMPT_KEYS), "prompts").items():
            text = self.scalar_text(v)
            if text is None or not text.isdigit() or not 1 <= int(text) <= PROMPT_KEYS[key]:
                self.error(v, f"prompts.{key}: a whole number from 1 to {PROMPT_KEYS[key]}")
            else:
                setattr(out, key, int(text))
        return out

    def mapping(self, node: Any, allowed: Tuple[str, ...], where: str) -> Dict[str, Any]:
        """{key: value node} of a mapping with only `allowed` keys, each once."""
        if not isinstance(node, yaml.MappingNode):
            self.error(node, f"{where}: a mapping of keys ({', '.join(allowed)})")
            return {}
        out: Dict[str, Any] = {}
        for k, v in node.value:
            key = str(k.value)
            if key not in allowed:
                self.error(k, f"{where}: unknown key {key!r}{phrase(closest(key, allowed))} (keys: {', '.join(allowed)})")
            elif key in out:
                self.error(k, f"{where}: {key!r} is given twice")
            else:
                out[key] = v
        return out

    def stage(self, node: Any, i: int, before: List[Stage]) -> Stage:
        where = f"stages[{i}]"
        items = self.mapping(node, STAGE_KEYS, where)
        name = self.name(items.get("name"), node, where, before)
        stage = Stage(name, node.start_mark.line + 1)
        if "recipe" in items:
            stage.recipe = self.recipe(items["recipe"], f"{where}.recipe")
        if "model_from" in items:
            stage.model_from = self.model_from(items["model_from"], f"{where}.model_from", before)
        if "from_export" in items:
            stage.from_export = self.from_export(items["from_export"], f"{where}.from_export", before)
        reserved = tuple(stage.exports_used())
        if "set" in items:
            stage.settings = self.settings(items["set"], f"{where}.set", reserved)
        return stage

    def from_export(self, node: Any, where: str, before: List[Stage]) -> Dict[str, str]:
        """`{KEY: STAGE}`: KEY (a path setting, e.g. a reward model's) takes that earlier stage's export."""
        if not isinstance(node, yaml.MappingNode):
            self.error(node, f"{where}: a mapping of keys to earlier stages (e.g. objective.reward_model: reward)")
            return {}
        out: Dict[str, str] = {}
        for k, v in node.value:
            key = str(k.value)
            if not all(_KEY_PART.match(p) for p in key.split(".")) or not self.known(key, leaf=True):
                self.error(k, f"{where}: {key!r} is not a key of the config"
                              f"{phrase(closest(key, sorted(self.keys)))}")
            elif any(key == r or key.startswith(r + ".") for r in PIPELINE_SET + ("model.path",)):
                self.error(k, f"{where}.{key}: set by the pipeline (model_from names the model's stage)")
            elif FIELDS.get(key) in SHARED_NEVER:  # it reaches `train` as a command-line override, like `set:`
                self.error(k, f"{where}.{key}: {SHARED_NEVER[FIELDS[key]]}")
            else:
                stage = self.model_from(v, f"{where}.{key}", before)
                if stage:
                    out[key] = stage
        return out

    def name(self, node: Any, parent: Any, where: str, before: List[Stage]) -> str:
        if node is None:
            self.error(parent, f"{where}.name: missing (it names the stage's run directory)")
            return f"stage{len(before)}"
        name = self.scalar_text(node)
        if name is None or not _NAME.match(name):
            self.error(node, f"{where}.name: a plain name (letters, digits, _ and -, up to 64, a letter first)")
            return f"stage{len(before)}"
        if any(s.name == name for s in before):
            self.error(node, f"{where}.name: {name!r} names an earlier stage too; each stage needs its own name")
        return name

    def recipe(self, node: Any, where: str) -> Optional[str]:
        text = self.scalar_text(node)
        if text is None or not _VALUE.match(text) or "$" in text:
            self.error(node, f"{where}: a shipped recipe's name or a recipe file's path")
            return None
        if text in group_options().get(RECIPE_GROUP, []):
            return text
        file = (self.path.parent / text).resolve()
        if text.endswith((".yaml", ".yml")) and file.is_file():
            return str(file)
        known = group_options().get(RECIPE_GROUP, [])
        self.error(node, f"{where}: {text!r} is neither a shipped recipe{phrase(closest(text, known))} nor a recipe "
                         f"file next to {self.path.name}")
        return None

    def model_from(self, node: Any, where: str, before: List[Stage]) -> Optional[str]:
        text = self.scalar_text(node)
        names = [s.name for s in before]
        if text not in names:
            self.error(node, f"{where}: {text!r} is not an earlier stage (earlier: {', '.join(names) or 'none'}); "
                             "the model comes from a stage that has run")
            return None
        return text

    def settings(self, node: Any, where: str, reserved: Tuple[str, ...]) -> List[Setting]:
        if not isinstance(node, yaml.MappingNode):
            self.error(node, f"{where}: a mapping of settings (key: value), as in a flat recipe")
            return []
        out: List[Setting] = []
        seen: Dict[str, int] = {}
        for k, v in node.value:
            for setting in self.setting(str(k.value), k, v, where, reserved):
                if setting.key in seen:
                    self.error(k, f"{where}.{setting.key}: set twice (also on line {seen[setting.key]})")
                seen[setting.key] = setting.line
                out.append(setting)
        return out

    def setting(self, key: str, k: Any, v: Any, where: str, reserved: Tuple[str, ...]) -> List[Setting]:
        """One `key: value` of a `set` mapping: a group choice, a leaf of the schema, or a mapping of them."""
        parts = key.split(".")
        if not all(_KEY_PART.match(p) for p in parts):
            code = " (Hydra's _target_ and the like name code to run; a pipeline is data)" if "_" in key[:1] or \
                any(p.startswith("_") for p in parts) else ""
            self.error(k, f"{where}: {key!r} is not a setting's key: dotted plain names{code}")
            return []
        if any(key == r or key.startswith(r + ".") for r in PIPELINE_SET + reserved):
            self.error(k, f"{where}.{key}: set by the pipeline (its run directory; model_from, from_export)")
            return []
        if key == RECIPE_GROUP:
            self.error(k, f"{where}.{key}: name a stage's recipe with the stage's `recipe:` key")
            return []
        if FIELDS.get(key) in SHARED_NEVER:  # its settings reach `train` as command-line overrides: checked here
            self.error(k, f"{where}.{key}: {SHARED_NEVER[FIELDS[key]]}")
            return []
        if key in self.groups and isinstance(v, yaml.ScalarNode):
            return self.group_choice(key, k, v, where)
        if isinstance(v, yaml.MappingNode) and not self.known(key, leaf=True):
            return [s for kk, vv in v.value for s in self.setting(f"{key}.{kk.value}", kk, vv, where, reserved)]
        if not self.known(key):
            self.error(k, f"{where}: {key!r} is not a key of the config{phrase(closest(key, sorted(self.keys)))}")
            return []
        value = self.value(v, f"{where}.{key}")
        options = OUTSIDE_OPTIONS.get(tuple(key.split(".")), ())  # (config/safety.py: a shared recipe's are refused)
        named = [a.partition("=")[0] for a in (value if isinstance(value, list) else []) if isinstance(a, str)
                 and a.partition("=")[0] in options]
        if named:
            self.error(k, f"{where}.{key}: {named[0]} {outside_by_hand(key)}")
            return []
        return [] if value is _BAD else [Setting(key, value, k.start_mark.line + 1)]

    def group_choice(self, key: str, k: Any, v: Any, where: str) -> List[Setting]:
        option = self.scalar_text(v)
        if option not in self.groups[key]:
            self.error(v, f"{where}.{key}: {option!r} is not an option of {key}"
                          f"{phrase(closest(str(option), self.groups[key]))} (options: {', '.join(self.groups[key])})")
            return []
        return [Setting(key, option, k.start_mark.line + 1)]

    def known(self, key: str, leaf: bool = False) -> bool:
        """A key of the schema (`leaf`: not an inner node), or one below a mapping-typed key of it."""
        if key in self.keys:
            return not leaf or not any(other.startswith(key + ".") for other in self.keys)
        parent = key.rpartition(".")[0]
        return bool(parent) and parent in self.keys and not any(o.startswith(parent + ".") for o in self.keys)

    def value(self, node: Any, where: str, depth: int = 0) -> Any:
        if isinstance(node, yaml.ScalarNode):
            value = yaml.SafeLoader("").construct_object(node) if node.tag != "tag:yaml.org,2002:str" else node.value
            if isinstance(value, str) and not _VALUE.match(value):
                bad = next((c for c in value if not re.match(VALUE_CHARS, c)), "$")
                self.error(node, f"{where}: {bad!r} is not allowed in a value (letters, digits, spaces and "
                                 "_.,:/@+=~%*?- and ${resolver:arg}; no quotes, shell characters or new lines)")
                return _BAD
            if value is not None and not isinstance(value, (str, int, float, bool)):
                self.error(node, f"{where}: a number, true/false, null or text, not a {type(value).__name__}")
                return _BAD
            return value
        if depth >= 2:
            self.error(node, f"{where}: nested too deeply for a setting")
            return _BAD
        if isinstance(node, yaml.SequenceNode):
            items = [self.value(n, where, depth + 1) for n in node.value]
            return _BAD if any(i is _BAD for i in items) else items
        pairs = [(str(k.value), self.value(v, f"{where}.{k.value}", depth + 1)) for k, v in node.value]
        if any(not _KEY_PART.match(k) for k, _ in pairs):
            self.error(node, f"{where}: mapping keys are plain names (a key starting with _ would name code)")
            return _BAD
        return _BAD if any(v is _BAD for _, v in pairs) else dict(pairs)

    def scalar_text(self, node: Any) -> Optional[str]:
        return str(node.value) if isinstance(node, yaml.ScalarNode) else None


_BAD = object()
