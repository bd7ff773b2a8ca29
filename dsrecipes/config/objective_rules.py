"""What each objective requires of a config, as tables, for the collect-all validation (`config/validate.py`):
`ROW_RULES` per `RowKind` (what any objective on those rows needs of the data: pairs carried by the strategy, no
packing, ...) and `RULES` per `ObjectiveKind` (its own keys). Adding an objective is its module, its option file,
its Enum value and its row here (tests/test_launcher_rules.py checks both tables are complete)."""

from __future__ import annotations

from typing import Callable, Dict, List, Tuple

from dsrecipes.core.schema import DpoLoss, ObjectiveConfig, ObjectiveKind, ReferenceMode, RowKind, TrainConfig
from dsrecipes.data.strategies.rules import caches_reference, carries_pairs
from dsrecipes.objectives.base import reference_mode

Rule = Callable[[TrainConfig], List[str]]  # every message names its key


def _name(cfg: TrainConfig) -> str:
    return f"objective={cfg.objective.kind.value}"


def _pairs_carried(cfg: TrainConfig) -> List[str]:
    if not carries_pairs(cfg):
        return [f"data.kind: data={cfg.data.kind.value} does not carry preference pairs ({_name(cfg)})"]
    if reference_mode(cfg) is ReferenceMode.precomputed and not caches_reference(cfg):
        return [f"objective.reference: precomputed reference log-probs are cached with the prepared pairs of "
                f"data=map; data={cfg.data.kind.value} reads each pair only on the rank that trains on it, so there "
                "is no pass before training to compute them in. Set objective.reference=live (with LoRA: the base "
                "model with its adapters disabled, no second copy), or use data=map"]
    return []


def _whole_pairs(cfg: TrainConfig) -> List[str]:
    return [f"data.packing: {_name(cfg)} trains on whole pairs; set data.packing=false"] if cfg.data.packing else []


def _positive_beta(cfg: TrainConfig) -> List[str]:
    beta = cfg.objective.beta
    return [] if beta > 0 else [f"objective.beta: must be > 0, got {beta}"]


def _dpo_loss(cfg: TrainConfig) -> List[str]:
    o, errors = cfg.objective, []
    top = 0.5 if o.loss is DpoLoss.robust else 1.0
    if not 0 <= o.label_smoothing < top:
        errors.append(f"objective.label_smoothing: must be in [0, {top}) for objective.loss={o.loss.value}, "
                      f"got {o.label_smoothing}")
    if o.loss is DpoLoss.ipo and o.label_smoothing:
        errors.append("objective.label_smoothing: objective.loss=ipo has no label smoothing; use sigmoid or robust")
    if o.loss is DpoLoss.simpo and o.reference is ReferenceMode.live:
        errors.append("objective.reference: objective.loss=simpo uses no reference model; drop objective.reference=live")
    if not o.simpo_gamma >= 0:
        errors.append(f"objective.simpo_gamma: must be >= 0, got {o.simpo_gamma}")
    return errors


def _whole_prompts(cfg: TrainConfig) -> List[str]:
    return [f"data.packing: {_name(cfg)} samples completions for whole prompts; set data.packing=false"
            ] if cfg.data.packing else []


def _grpo(cfg: TrainConfig) -> List[str]:
    from dsrecipes.objectives.rewards import reward_problems  # lazy: reads installed entry points

    o, errors = cfg.objective, []
    if o.num_generations < 2:
        errors.append(f"objective.num_generations: must be >= 2 (advantages compare completions of a prompt), "
                      f"got {o.num_generations}")
    if not 1 <= o.max_completion_length < cfg.data.cutoff_len:
        errors.append(f"objective.max_completion_length: must be in [1, data.cutoff_len={cfg.data.cutoff_len}), "
                      f"got {o.max_completion_length}")
    if not o.temperature > 0:
        errors.append(f"objective.temperature: must be > 0, got {o.temperature}")
    if not 0 < o.epsilon < 1:
        errors.append(f"objective.epsilon: must be in (0, 1), got {o.epsilon}")
    if o.beta < 0:
        errors.append(f"objective.beta: must be >= 0, got {o.beta}")
    if o.beta > 0 and not cfg.model.lora.enabled:
        errors.append("objective.beta: the KL term's reference is the LoRA base with adapters disabled; set "
                      "model.lora.enabled=true, or objective.beta=0")
    return errors + reward_problems(cfg)


def _reward(cfg: TrainConfig) -> List[str]:
    """objective=reward: a scalar head generates nothing (no prompt-eval); the centering weight is >= 0."""
    errors, center = [], cfg.objective.center_rewards_coefficient
    if center is not None and not center >= 0:
        errors.append(f"objective.center_rewards_coefficient: must be >= 0 (or null: off), got {center}")
    if cfg.trainer.prompt_eval_every:
        errors.append("trainer.prompt_eval_every: objective=reward trains a scoring head that generates no answers; "
                      "set trainer.prompt_eval_every=0 (evaluation reports eval_reward_accuracy)")
    return errors


_K = ObjectiveKind
# The objective keys only some objectives read. One set away from its default under another objective is refused: a
# TRL DPO or GRPO file translated without `objective: dpo|grpo` (TRL picks the trainer, not a key) would else train
# SFT with its beta, loss and num_generations unread. (Not here: objective.reference=live and
# objective.label_smoothing, harmless elsewhere, which tests set across objectives.)
READ_BY: Dict[str, Tuple[ObjectiveKind, ...]] = {
    "beta": (_K.dpo, _K.orpo, _K.grpo), "loss": (_K.dpo,), "simpo_gamma": (_K.dpo,),
    "num_generations": (_K.grpo,), "max_completion_length": (_K.grpo,), "temperature": (_K.grpo,),
    "epsilon": (_K.grpo,), "rewards": (_K.grpo,), "reward_model": (_K.grpo,), "reward_model_weight": (_K.grpo,),
    "center_rewards_coefficient": (_K.reward,),
}


def _unread(cfg: TrainConfig) -> List[str]:
    default, errors = ObjectiveConfig(), []
    for key, kinds in READ_BY.items():
        value = getattr(cfg.objective, key)
        if cfg.objective.kind not in kinds and value != getattr(default, key):
            readers = " or ".join(f"objective={kind.value}" for kind in kinds)
            default_kind = " (the default)" if cfg.objective.kind is default.kind else ""
            errors.append(f"objective.{key}: only {readers} reads it, and this run is {_name(cfg)}{default_kind}: "
                          f"choose the objective (objective={kinds[0].value}), or drop objective.{key}")
    return errors


ROW_RULES: Dict[RowKind, Tuple[Rule, ...]] = {
    RowKind.conversation: (),
    RowKind.pair: (_pairs_carried, _whole_pairs),
    RowKind.prompt: (_whole_prompts,),
}

RULES: Dict[ObjectiveKind, Tuple[Rule, ...]] = {
    ObjectiveKind.sft: (),
    ObjectiveKind.dpo: (_positive_beta, _dpo_loss),
    ObjectiveKind.orpo: (_positive_beta,),
    ObjectiveKind.grpo: (_grpo,),
    ObjectiveKind.reward: (_reward,),
}


def objective_problems(cfg: TrainConfig) -> List[str]:
    """Every objective rule `cfg` breaks: its rows' rules, then its own."""
    rules = (_unread,) + ROW_RULES.get(cfg.objective.rows, ()) + RULES.get(cfg.objective.kind, ())
    return [problem for rule in rules for problem in rule(cfg)]
