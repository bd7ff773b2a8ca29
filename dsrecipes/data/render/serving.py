"""What makes an exported model ready to serve: the training template, the right stop tokens, the KV cache on.

Every export (full, merged LoRA, adapter-only LoRA, and the tiny model's `export_init/` baseline) goes through
`make_servable` before it is saved:
- the tokenizer's `chat_template` becomes the Jinja rendering of the run's template (data/render/jinja.py), so any server
  that calls `apply_chat_template` prompts the model exactly as it was trained;
- `generation_config.eos_token_id` lists the template's end-of-turn token (`<|im_end|>`, `<|eot_id|>`, `</s>`, the
  tokenizer's eos for plain/human_assistant, whatever the model's own template closes a reply with) and the eos
  token, so plain `model.generate` stops at the end of the answer;
- `use_cache` is true again (training switches it off; generation without a KV cache is quadratic);
- `do_sample` is explicit: the base model's sampling settings when it has them, else greedy (decoding.py), so stock
  `pipeline` and `generate` answer alike.
`dsrecipes_export.json` (export.py) beside the weights records where the export came from (run, step, template, the base model of
an adapter), which prompt-eval and chat use to find the run's validation data and an adapter's base.
"""

from __future__ import annotations

from typing import Any, Dict, List

from dsrecipes.core.schema import TemplateConfig, TrainConfig, TrainOn
from dsrecipes.core.typed import config_to_dict
from dsrecipes.data.render.decoding import settle_decoding
from dsrecipes.data.render.jinja import chat_template
from dsrecipes.data.render.template import render
from dsrecipes.data.render.template_choice import choose_template
from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

_REPLY = "DSRECIPESREPLY"


def run_template(cfg: TrainConfig, tokenizer: Any) -> TemplateConfig:
    """The concrete template of a run (config.yaml of a launched run already holds one; `auto` is resolved the
    same way the launch resolves it)."""
    return choose_template(cfg.template, tokenizer, cfg.model.path)


def end_of_turn_ids(template: TemplateConfig, tokenizer: Any) -> List[int]:
    """Token ids that end a reply under `template` (its special end-of-turn token, then the eos token)."""
    probe = Conversation("eot", [Turn(Role.user, "Hi"), Turn(Role.assistant, _REPLY)])
    trained = [seg.text for seg in render(probe, template, tokenizer, TrainOn.assistant) if seg.trained]
    suffix = trained[-1].split(_REPLY, 1)[-1] if trained else ""
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids = [i for i in tokenizer(suffix, add_special_tokens=False)["input_ids"] if i in special][-1:]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def make_servable(model: Any, tokenizer: Any, cfg: TrainConfig) -> Dict[str, Any]:
    """Set chat template, stop tokens and use_cache on `model` / `tokenizer` (a PeftModel's base too); returns the
    facts for dsrecipes_export.json."""

    template = run_template(cfg, tokenizer)
    tokenizer.chat_template = chat_template(template, tokenizer)
    stops = end_of_turn_ids(template, tokenizer)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoding = None
    for target in {id(model): model, id(base): base}.values():
        decoding = settle_decoding(getattr(target, "generation_config", None)) or decoding  # (decoding.py)
        if getattr(target, "config", None) is not None:
            target.config.use_cache = True
        gen = getattr(target, "generation_config", None)
        if gen is not None and stops:
            gen.eos_token_id = stops if len(stops) > 1 else stops[0]
            gen.pad_token_id = tokenizer.pad_token_id
            gen.use_cache = True
            gen._from_model_config = False  # else generate() may rebuild it from config.json, dropping the stops
    return {"template": config_to_dict(template), "end_of_turn_ids": stops, "decoding": decoding}
