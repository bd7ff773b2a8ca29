"""The rewards of `objective=grpo`, chosen by name in the recipe (`objective.rewards`), never by code path.

    rewards(completion: str, reference: str) -> {part name: float}, summed with the weights into the reward

Built-in typed checks (reward 1.0 or 0.0; completions and references are text):
- `exact_match`   the completion equals the reference after normalisation (core/answers.py: case-folded,
                  whitespace collapsed; the rule prompt-eval scores with). No reference: 0.
- `number_equal`  the last number in the completion equals the reference read as a number (|a - b| <= 1e-9).
- `regex`         the completion matches `pattern` (re.search's syntax; a pattern that does not compile is refused
                  at validation, naming its key; one search past PATTERN_SECONDS is one ConfigError).
- `length`        `min_chars <= len(completion) <= max_chars` (max_chars null: no upper bound).
Anything else is the name of a function an INSTALLED package registers under the entry point group
`dsrecipes.rewards` (`[project.entry-points."dsrecipes.rewards"] my_reward = "my_pkg.rewards:score"`, called as
`score(completion, reference) -> float`); a name that is neither built in nor installed is refused with the
installed names. The recipe names; the installed package decides what runs.

`objective.reward_model`: a sequence-classification model directory (`objective=reward`'s export: config,
safetensors, tokenizer beside); its logit for (prompt + completion) is the part `reward_model`. It loads with the
checks of every model directory (no custom code, safetensors only); a directory that fails is one ConfigError.
Under ZeRO-3 (GRPO passes the run's DeepSpeed config) it loads partitioned (zero.Init: never whole on a rank) into a
DeepSpeed engine without optimizer (objectives/frozen.py, as DPO's live reference): each rank holds 1/world of it, in
the dtype it was saved in (as ZeRO-2's whole copy, so both stages score alike). Its forward is then a collective,
and every rank scores alike: `Rewards.parts` is called once per GRPO micro-batch (grpo.py sample_and_score), and
every rank runs the same micro-batches per step and per evaluation (a rank without a prompt scores its placeholder
prompt's completions; rank/evaluation.py pads with those); a call with no text runs a one-token dummy forward.
ZeRO-0/1/2: a whole copy on the rank's device, as the policy's weights are whole there too. Either way each rank says
on stderr what it holds: `dsrecipes: rank R: reward model holds H of its T parameters (ZeRO-3 partitioned), in
float32`.
"""

from __future__ import annotations

import math
import re
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import dsrecipes.boundary.trust as trust
from dsrecipes.core.answers import normalize
from dsrecipes.core.errors import ConfigError, UserError, no_custom_code
from dsrecipes.core.export_dir import merge_first
from dsrecipes.core.schema import RewardConfig, TrainConfig
from dsrecipes.core.tokenizer import NO_DIRECTORY_CODE, custom_code_problems, not_a_scorer

GROUP = "dsrecipes.rewards"
BUILTIN = ("exact_match", "number_equal", "regex", "length")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
Check = Callable[[str, str], float]
PATTERN_SECONDS = 1.0  # one regex reward's search of one completion (a sane pattern takes microseconds)


def installed() -> Dict[str, Any]:
    """{name: entry point} of every function installed under `dsrecipes.rewards`."""
    return {ep.name: ep for ep in entry_points(group=GROUP)}


def reward_problems(cfg: TrainConfig) -> List[str]:
    """Every problem of `objective.rewards` / `objective.reward_model` (config/validate.py), each naming its key."""
    o, errors = cfg.objective, []
    if not o.rewards and not o.reward_model:
        errors.append("objective.rewards: objective=grpo needs a reward: objective.rewards=[{name: exact_match}] "
                      "(built-in: exact_match, number_equal, regex, length) and/or objective.reward_model=DIR")
    names = None  # the directory of objective.reward_model is a file check (config/validate.py, before launch)
    for i, r in enumerate(o.rewards):
        key = f"objective.rewards[{i}]"
        if r.name == "regex":
            errors += _pattern_problems(key, r.pattern)
        elif r.name == "length" and (r.min_chars < 0 or (r.max_chars is not None and r.max_chars < r.min_chars)):
            errors.append(f"{key}.max_chars: length bounds must satisfy 0 <= min_chars <= max_chars")
        elif r.name not in BUILTIN:
            names = installed() if names is None else names
            if r.name not in names:
                errors.append(f"{key}.name: {r.name!r} is neither a built-in reward ({', '.join(BUILTIN)}) nor "
                              f"installed under the entry point group {GROUP!r} (installed: {sorted(names) or 'none'})")
        if not math.isfinite(r.weight):
            errors.append(f"{key}.weight: must be a finite number, got {r.weight}")
    return errors


def reward_model_problems(path: str) -> List[str]:
    """Before anything launches: a directory with a config, safetensors weights, and no code of its own, and a
    dsrecipes export signed by this user (or trusted: train's --trust-checkpoint) holding its files as written, as
    chat loads one (boundary/trust.check_export). The ranks, which have no command line to trust with, check again
    right before the weights load (load_reward_model): signed by this user, or the record their launching process
    accepted (plan.json's exports, trust.launched); any other failure there is one ConfigError too."""
    key, found = "objective.reward_model", Path(path).expanduser()
    if not found.is_dir():
        return [f"{key}: {path} is not a directory (an objective=reward export: config.json, *.safetensors, tokenizer)"]
    if not (found / "config.json").is_file() or next(found.glob("*.safetensors"), None) is None:
        return [f"{key}: {path} has no config.json or no *.safetensors weights (dsrecipes loads model weights only "
                f"from safetensors); give an objective=reward export{merge_first(found)}"]
    try:
        trust.check_export(found, trust.run_command())
    except UserError as exc:
        return [f"{key}: {p}" for p in exc.problems]
    return custom_code_problems(key, found) or _scorer_problems(key, path, found / "config.json")


def _scorer_problems(key: str, path: str, config: Path) -> List[str]:
    """A model without a one-label head (an SFT/DPO export) loads as a sequence classifier with a new, random head:
    every reward would be noise, and the run trained on it without a word."""
    try:
        found = not_a_scorer(config)
    except UserError as exc:
        return [f"{key}: {p}" for p in exc.problems]
    if found is None:
        return []
    if found.generator:
        return [f"{key}: {path} is a text-generating model ({found.generator}), not a reward model: its score head "
                "would be new and random, and so every reward; give an objective=reward export"]
    return [f"{key}: {path} has {found.labels} labels in config.json; a reward model has one (a scalar score): give "
            "an objective=reward export"]


def _pattern_problems(key: str, pattern: Optional[str]) -> List[str]:
    if not pattern:
        return [f"{key}.pattern: the regex reward needs a pattern"]
    import regex  # lazy: what _regex_check searches with

    try:
        re.compile(pattern)
        regex.compile(pattern, regex.VERSION0)
    except (re.error, regex.error) as exc:
        return [f"{key}.pattern: {pattern!r} is not a regular expression ({exc})"]
    return []


def check_of(r: RewardConfig) -> Check:
    """The function of one reward (built in, else the installed entry point, loaded here)."""
    if r.name == "exact_match":
        return lambda text, ref: float(bool(ref) and normalize(text) == normalize(ref))
    if r.name == "number_equal":
        return _number_equal
    if r.name == "regex":
        return _regex_check(r.pattern or "")
    if r.name == "length":
        top = math.inf if r.max_chars is None else r.max_chars
        return lambda text, ref: float(r.min_chars <= len(text) <= top)
    found = installed().get(r.name)
    if found is None:
        raise ConfigError(f"objective.rewards: {r.name!r} is not installed under the entry point group {GROUP!r}")
    return found.load()


def _regex_check(source: str) -> Check:
    """re.search of a recipe's pattern, bounded in time: `re` cannot stop a pattern that backtracks exponentially
    (`(a|aa)+$`), which would stall the rank with no message; the `regex` module (transformers' own dependency)
    searches the same syntax with a timeout, past which the recipe's pattern is one ConfigError naming it."""
    import regex  # lazy: only a regex reward needs it

    pattern = regex.compile(source, regex.VERSION0)  # VERSION0: re's syntax and meaning

    def check(text: str, ref: str) -> float:
        try:
            return float(pattern.search(text, timeout=PATTERN_SECONDS) is not None)
        except TimeoutError:
            raise ConfigError(f"objective.rewards: the regex pattern {source!r} ran past {PATTERN_SECONDS:g} s on "
                              f"one completion of {len(text)} characters (it backtracks exponentially); rewrite it "
                              "without nested or overlapping repetition") from None

    return check


def _number_equal(text: str, ref: str) -> float:
    got, want = NUMBER.findall(text), NUMBER.findall(ref)
    if not got or len(want) != 1:
        return 0.0
    return float(abs(float(got[-1]) - float(want[0])) <= 1e-9)


class Rewards:
    """Every configured reward: `parts(prompts, completions, references)` -> {name: [reward per completion]} and
    `weights` {name: weight}; built on the rank (not pickled into loader workers)."""

    def __init__(self, cfg: TrainConfig, device: Any = None, ds_config: Optional[Dict[str, Any]] = None):
        """`ds_config`: the run's DeepSpeed config, given under ZeRO-3 (the reward model partitioned), else None."""
        o = cfg.objective
        self.checks = {name: (check_of(r), r.weight) for name, r in zip(part_names(cfg), o.rewards)}
        self.weights = {name: w for name, (_, w) in self.checks.items()}
        self.model = load_reward_model(o.reward_model, device, ds_config) if o.reward_model else None
        if self.model is not None:
            self.weights["reward_model"] = o.reward_model_weight

    def parts(self, prompts: List[str], completions: List[str], references: List[str]) -> Dict[str, List[float]]:
        out = {name: [float(fn(c, r)) for c, r in zip(completions, references)]
               for name, (fn, _) in self.checks.items()}
        if self.model is not None:
            out["reward_model"] = self.model([p + c for p, c in zip(prompts, completions)])
        return out


def part_names(cfg: TrainConfig) -> List[str]:
    """The metric name of every reward part: the reward's name (`<name>_<i>` when named twice), `reward_model`."""
    o = cfg.objective
    names = [r.name for r in o.rewards]
    out = [f"{n}_{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]
    return out + (["reward_model"] if o.reward_model else [])


def load_reward_model(path: str, device: Any, ds_config: Optional[Dict[str, Any]] = None
                      ) -> Callable[[List[str]], List[float]]:
    """A sequence-classification directory -> texts -> [score]: no custom code, safetensors only, and an export
    checked again here, where it loads (on a rank: signed by this user, or the very record its launching process
    accepted: trust.launched); any failure to load is one ConfigError naming objective.reward_model. With a ZeRO-3
    `ds_config`: partitioned, in a DeepSpeed inference engine (the module docstring); else whole on `device`."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    key = "objective.reward_model"
    problems = reward_model_problems(path)
    if problems:
        raise ConfigError(problems)
    import dsrecipes.objectives.frozen as frozen  # lazy: torch, deepspeed (validation imports this module)

    zero3 = ds_config is not None
    try:  # partitioned under ZeRO-3; else whole, outside the policy's ZeRO-3 load config (if any)
        with no_custom_code(key, path), frozen.partitioned(ds_config) if zero3 else frozen.not_partitioned():
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
            model = AutoModelForSequenceClassification.from_pretrained(path, use_safetensors=True,
                                                                       **NO_DIRECTORY_CODE)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises on a broken directory
        raise ConfigError(f"{key}: {path} does not load as a sequence-classification model "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.config.pad_token_id = tok.pad_token_id
    model.eval().requires_grad_(False)
    if zero3:
        run = frozen.inference_engine(model, ds_config)
        where, rank = run.device, run.global_rank
    else:
        run, where = model.to(device or "cpu"), device or "cpu"
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    frozen.say_held("reward model", run, rank, zero3)

    def score(texts: List[str]) -> List[float]:
        with torch.no_grad():
            if not texts:  # ZeRO-3: the forward is a collective the other ranks run; nothing to score here
                if zero3:
                    one = torch.full((1, 1), tok.pad_token_id, dtype=torch.long, device=where)
                    run(input_ids=one, attention_mask=torch.ones_like(one))
                return []
            enc = tok(texts, return_tensors="pt", padding=True, truncation=True).to(where)
            return run(**enc).logits[:, 0].float().tolist()

    return score
