"""A LLaMA-Factory user's first day: an LF experiment file whose keys LLaMA-Factory reads together (DataArguments'
__post_init__, its loader) keeps their meaning in the translated file, or is left to a person with the reason."""

from __future__ import annotations

import yaml

from dsrecipes.config.flat_check import flat_problems, in_our_keys


def _problems(text: str) -> str:
    return "\n".join(flat_problems(yaml.safe_load(text), "lf.yaml", lambda key: None))


def _ours(text: str) -> str:
    return in_our_keys(yaml.safe_load(text)) or ""


def test_neat_packing_packs_even_beside_packing_false():
    """LF: `if self.neat_packing: self.packing = True`. The translation took `packing: false` (the first key) and
    dropped neat_packing's data.packing: true, so the migrated run did not pack."""
    text = "stage: sft\npacking: false\nneat_packing: true\n"
    ours = _ours(text)
    assert "data.packing: true" in ours and "data.packing: false" not in ours, ours
    assert "neat_packing: true in this file turns packing on" in _problems(text)


def test_plain_packing_says_that_packed_samples_do_not_see_each_other_here():
    said = _problems("packing: true\n")
    assert "data.packing: true" in said and "attend to each other" in said, said


def test_train_on_prompt_with_mask_history_is_left_to_a_person_as_llamafactory_refuses_it():
    """LF raises '`mask_history` is incompatible with `train_on_prompt`'; the translation wrote data.train_on: all
    (the first key) and dropped mask_history without a word."""
    text = "stage: sft\ntrain_on_prompt: true\nmask_history: true\n"
    ours = _ours(text)
    assert "# train_on_prompt: true" in ours and "# mask_history: true" in ours, ours
    assert "data.train_on" not in ours, ours
    said = _problems(text)
    assert said.count("incompatible with `train_on_prompt`") == 2 and "choose one" in said, said
