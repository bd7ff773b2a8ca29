"""A pipeline's prompt answers side by side (`prompts: {limit, max_new_tokens}` in a pipeline file): the base model
(the first stage's starting model), then the export of every stage that generates text, in stage order, answer the
same held-out prompts greedily; `pipeline_prompts.md` holds the answers and the scores (prompt_eval.py's).

The prompts are the first stage's validation conversations (usually SFT: data=map keeps them). Every model is
prompted through the last generating stage's template and stopped at its end-of-turn tokens, as
`dsrecipes prompt-eval` does for a baseline. A stage whose export is not a causal language model (a reward model's
sequence-classification head) has no answers and is left out. Models are loaded one at a time.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from dsrecipes.core.export_dir import EXPORT_DIR, architectures
from dsrecipes.core.fileio import atomic_write_text
from dsrecipes.serve.inference import ChatModel, adapter_config, resolve_model_path
from dsrecipes.serve.prompt_eval import PromptRow, Score, evaluate, prompt_rows

PROMPTS_MD = "pipeline_prompts.md"


def answer_stages(out: Path, stages: Sequence[Tuple[str, Path]], limit: int, max_new_tokens: int) -> str:
    """Answer, score and write `out/pipeline_prompts.md`; returns the scores as console lines."""
    first = stages[0][1]
    rows = prompt_rows(resolve_model_path(str(first), retry=_retry(first)), None, limit)
    talking = [(name, run_dir) for name, run_dir in stages if generates(run_dir / EXPORT_DIR)]
    if not talking:
        return "prompt answers: no stage exports a model that generates text"
    final = ChatModel(resolve_model_path(str(talking[-1][1]), retry=_retry(talking[-1][1])))
    template, stops = final.tokenizer.chat_template, final.stop_ids
    scores: Dict[str, Score] = {}
    base = ChatModel(resolve_model_path(str(first), baseline=True, retry=_retry(first, baseline=True)), template,
                     stops)
    scores["base"] = evaluate(base, rows, max_new_tokens)
    del base
    for name, run_dir in talking[:-1]:
        model = ChatModel(resolve_model_path(str(run_dir), retry=_retry(run_dir)), template, stops)
        scores[name] = evaluate(model, rows, max_new_tokens)
        del model
    scores[talking[-1][0]] = evaluate(final, rows, max_new_tokens)
    table = score_lines(scores)
    atomic_write_text(out / PROMPTS_MD, _markdown(rows, scores, table))
    return "\n".join(["prompt answers (base, then each stage):", *table, f"answers    {out / PROMPTS_MD}"])


def generates(export: Path) -> bool:
    """Whether an export is a causal language model (its config.json's architectures), or a LoRA adapter of one."""
    if (export / "adapter_config.json").is_file():
        return adapter_config(export).get("task_type") in (None, "CAUSAL_LM")
    return any(a.endswith("ForCausalLM") for a in architectures(export))


def score_lines(scores: Dict[str, Score]) -> List[str]:
    lines = ["| model | exact | similarity | reference loss | stopped at end of turn |", "|---|---|---|---|---|"]
    for name, s in scores.items():
        lines.append(f"| {name} | {s.exact}/{s.total} | {s.similarity:.3f} | {s.reference_loss:.3f} | "
                     f"{s.stopped}/{len(s.answers)} |")
    return lines


def _markdown(rows: List[PromptRow], scores: Dict[str, Score], table: List[str]) -> str:
    parts = ["# prompt answers, base -> each stage", "", *table, ""]
    for i, row in enumerate(rows):
        parts += [f"## {i + 1}. {row.title}", ""]
        parts += [f"- **{name}**: {score.answers[i]!r}" for name, score in scores.items()]
        if row.reference is not None:
            parts.append(f"- *reference*: {row.reference!r}")
        parts.append("")
    return "\n".join(parts)


def _retry(run_dir: Path, baseline: bool = False) -> str:
    """The command a refusal to load a stage's model names, to repeat with `--trust-checkpoint PATH`: prompt-eval on
    that stage (the pipeline has no such flag: trust is never carried between stages, commands/pipeline.py)."""
    where = shlex.quote(str(run_dir.resolve()))
    return f"dsrecipes prompt-eval --finetuned {where}" + (f" --baseline {where}" if baseline else "")
