"""The decoding an export asks for: the base model's sampling settings when it has them, else greedy.

Stock `transformers.pipeline("text-generation")` fills every generation parameter that the model's
generation_config leaves unset with its own defaults (`do_sample=True, temperature=0.7`), while `model.generate`
decodes greedily when `do_sample` is unset; an export that leaves it unset therefore answers differently through the
two doors, and differently on every pipeline call. `settle_decoding` writes `do_sample` explicitly: a base model
that samples (its generation_config.json sets `do_sample: true`, with its temperature/top_p) keeps that; anything
else is written as greedy (`do_sample: false`), so `pipeline` and `generate` agree and repeat themselves.
"""

from __future__ import annotations

from typing import Any, Optional


def settle_decoding(generation_config: Any) -> Optional[str]:
    """Set `do_sample` on a transformers GenerationConfig in place; returns "sampling" (the base model's own
    settings, kept) or "greedy" (written), None when there is no generation config."""
    if generation_config is None:
        return None
    if getattr(generation_config, "do_sample", None):
        return "sampling"
    generation_config.do_sample = False
    generation_config._from_model_config = False  # else generate() may rebuild it from config.json, losing this
    return "greedy"
