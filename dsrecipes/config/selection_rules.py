"""Rules of the evaluation and model-selection settings (`trainer.eval_*`, `trainer.save_best`,
`trainer.early_stopping`, `trainer.prompt_eval_*`), collected by config/validate.py; rank/selection.py applies them."""

from __future__ import annotations

from typing import List

from dsrecipes.core.schema import SelectMetric, TrainConfig, TrainOn
from dsrecipes.data.strategies.rules import has_prompt_rows

PROMPT_METRICS = frozenset(m for m in SelectMetric if m.value.startswith("prompt_"))


def config_problems(cfg: TrainConfig) -> List[str]:
    """Rules of the evaluation and selection settings (config/validate.py collects them)."""
    t, errors = cfg.trainer, []
    if t.eval_batches is not None:
        errors.append("trainer.eval_batches: replaced by trainer.eval_samples (validation samples per evaluation over "
                      "all ranks, so that the number does not depend on the world size); set "
                      f"trainer.eval_samples={t.eval_batches * t.micro_batch_size} (or null for every sample) instead")
    if t.eval_samples is not None and t.eval_samples < 1:
        errors.append(f"trainer.eval_samples: a number of samples >= 1, or null for all, got {t.eval_samples}")
    es = t.early_stopping
    if es.patience < 0:
        errors.append(f"trainer.early_stopping.patience: evaluations >= 0 (0 = off), got {es.patience}")
    if es.min_delta < 0:
        errors.append(f"trainer.early_stopping.min_delta: must be >= 0, got {es.min_delta}")
    if t.save_best.metric in PROMPT_METRICS and t.prompt_eval_every <= 0:
        errors.append(f"trainer.save_best.metric: {t.save_best.metric.value} comes from prompt-evals during training; "
                      "set trainer.prompt_eval_every, or choose an eval_* metric")
    return errors + _prompt_eval_problems(cfg)


def _prompt_eval_problems(cfg: TrainConfig) -> List[str]:
    t, errors = cfg.trainer, []
    if t.prompt_eval_every < 0:
        errors.append(f"trainer.prompt_eval_every: steps >= 0 (0 = off), got {t.prompt_eval_every}")
    if t.prompt_eval_samples < 1 or t.prompt_eval_max_new_tokens < 1:
        errors.append("trainer.prompt_eval_samples: prompt_eval_samples and prompt_eval_max_new_tokens must be >= 1")
    if t.prompt_eval_every > 0 and (not has_prompt_rows(cfg) or cfg.dataset.val_size == 0):
        errors.append("trainer.prompt_eval_every: prompts come from the prepared validation split, which needs "
                      "data=map and dataset.val_size > 0")
    if t.prompt_eval_every > 0 and cfg.data.train_on is TrainOn.all:
        errors.append("trainer.prompt_eval_every: with data.train_on=all the whole conversation is trained, so there "
                      "is no prompt to cut off; use train_on=assistant or last_assistant")
    return errors
