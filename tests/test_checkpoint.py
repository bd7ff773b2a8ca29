"""checkpoint.py without a process group: which checkpoint resumes, retention, RNG round trip, initial export."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from dsrecipes.boundary.checkpoint_find import find_resume_checkpoint, latest_complete, plan_resume
from dsrecipes.boundary.trust import sign
from dsrecipes.core.errors import UserError
from dsrecipes.core.schema import ResumeMode, TrainerConfig
from dsrecipes.rank.checkpoint import COMPLETE, LATEST, prune_checkpoints, restore_rng, rng_state
from dsrecipes.rank.export import export_initial

AUTO, NEVER = TrainerConfig(resume=ResumeMode.auto), TrainerConfig(resume=ResumeMode.never)


def resume_from(path) -> TrainerConfig:
    return TrainerConfig(resume_from=str(path))


def _ckpt(root, step, complete=True):
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    if complete:
        (d / COMPLETE).write_text(json.dumps(sign({"step": step, "world_size": 2})))  # as this user's runs sign it
    return d


def test_resume_auto_uses_latest_and_ignores_a_partial_save(tmp_path):
    root = tmp_path / "checkpoints"
    assert find_resume_checkpoint(AUTO, tmp_path) is None
    _ckpt(root, 2)
    good = _ckpt(root, 4)
    (root / LATEST).write_text("step_4")
    _ckpt(root, 6, complete=False)  # killed mid-save: no marker, latest not switched
    assert find_resume_checkpoint(AUTO, tmp_path) == good
    assert find_resume_checkpoint(NEVER, tmp_path) is None
    # a latest pointer naming an incomplete dir falls back to the newest complete one
    (root / LATEST).write_text("step_6")
    assert latest_complete(root) == good


def test_resume_from_a_path(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    two, four = _ckpt(root, 2), _ckpt(root, 4)
    (root / LATEST).write_text("step_4")
    assert find_resume_checkpoint(resume_from(two), tmp_path) == two
    assert find_resume_checkpoint(resume_from(root), tmp_path) == four
    assert find_resume_checkpoint(resume_from(tmp_path / "run"), tmp_path) == four
    with pytest.raises(UserError, match="not a complete checkpoint"):
        find_resume_checkpoint(resume_from(_ckpt(root, 6, complete=False)), tmp_path)


def test_the_plan_says_whether_a_resume_is_elastic(tmp_path):
    root = tmp_path / "checkpoints"
    assert plan_resume(AUTO, tmp_path, world_size=2, zero_stage=2) is None
    _ckpt(root, 4)  # written by 2 ranks
    same = plan_resume(AUTO, tmp_path, world_size=2, zero_stage=2)
    assert (same.step, same.saved_world_size, same.elastic) == (4, 2, False)
    assert plan_resume(AUTO, tmp_path, world_size=1, zero_stage=2).elastic  # ZeRO-2 shards: universal checkpoint
    assert not plan_resume(AUTO, tmp_path, world_size=1, zero_stage=0).elastic  # ZeRO-0 states are whole
    assert plan_resume(NEVER, tmp_path, world_size=2, zero_stage=2) is None


def test_prune_keeps_the_newest_complete_and_removes_partial_leftovers(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        _ckpt(root, step)
    _ckpt(root, 4, complete=False)  # an old partial save
    _ckpt(root, 5)
    prune_checkpoints(root, keep=2)
    assert sorted(d.name for d in root.iterdir()) == ["step_3", "step_5"]


def test_rng_round_trip():
    state = rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1))
    restore_rng(state)
    b = (random.random(), np.random.rand(), torch.rand(1))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_initial_export_reloads_with_the_chat_template(make_cfg, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsrecipes.modeling.model import build_model, load_tokenizer

    cfg = make_cfg("debug=fast")
    tokenizer = load_tokenizer(cfg)
    out = export_initial(cfg, tokenizer, tmp_path / "export_init")
    assert (out / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    reference = build_model(cfg, tokenizer)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
    # The run's template (chatml, as Jinja); it renders what the bundled tokenizer's own chatml template renders.
    exported = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert exported.chat_template != tokenizer.chat_template
    assert exported.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages, tokenize=False)
    assert model.generation_config.eos_token_id == [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    assert model.config.use_cache and tokenizer.chat_template  # the caller's tokenizer keeps its own template
