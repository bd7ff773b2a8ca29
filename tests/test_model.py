"""model.py: the embedded tiny model, LoRA, gradient checkpointing, and the packing-aware loss (no process group)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dsrecipes.modeling.model import build_model, count_parameters, load_tokenizer, trainable_parameters
from dsrecipes.objectives.base import IGNORE_INDEX
from dsrecipes.objectives.sft import micro_batch_loss, token_loss_sum


@pytest.fixture
def cfg(make_cfg):
    return make_cfg("debug=fast")


def test_tiny_model_uses_bundled_tokenizer_and_seeded_init(cfg, make_cfg):
    tokenizer = load_tokenizer(cfg)
    assert tokenizer.pad_token is not None and tokenizer.chat_template
    a, b = build_model(cfg, tokenizer), build_model(cfg, tokenizer)
    assert a.config.vocab_size == len(tokenizer)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    other = build_model(make_cfg("debug=fast", "model.tiny.seed=7"), tokenizer)
    assert not torch.equal(a.model.embed_tokens.weight, other.model.embed_tokens.weight)
    # trainer.seed drives data order, not the start model
    same = build_model(make_cfg("debug=fast", "trainer.seed=5"), tokenizer)
    assert torch.equal(a.model.embed_tokens.weight, same.model.embed_tokens.weight)
    # building the model does not consume the training RNG
    torch.manual_seed(0)
    build_model(cfg, tokenizer)
    after_build = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(1), after_build)


def test_dtype_follows_precision(make_cfg):
    cfg = make_cfg("debug=fast", "precision=bf16")
    model = build_model(cfg, load_tokenizer(cfg))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_lora_trains_only_adapters_unless_asked(make_cfg):
    cfg = make_cfg("debug=fast", "model.lora.enabled=true")
    model = build_model(cfg, load_tokenizer(cfg))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    trainable, total = count_parameters(model)
    assert 0 < trainable < total and trainable == sum(p.numel() for p in trainable_parameters(model))
    cfg = make_cfg("debug=fast", "model.lora.enabled=true", "model.lora.only_optimize_lora=false")
    model = build_model(cfg, load_tokenizer(cfg))
    assert all(p.requires_grad for p in model.parameters())


def test_loss_ignores_minus_100_and_packing_boundaries():
    torch.manual_seed(0)
    logits = torch.randn(1, 6, 11)
    labels = torch.tensor([[IGNORE_INDEX, 3, 4, 5, 6, 7]])
    # two packed samples: positions 0-2 and 0-2; token 3 starts sample 2 and must not be predicted from token 2
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2]])
    loss_sum, n = token_loss_sum(logits, labels, position_ids)
    targets = [(0, 3), (1, 4), (3, 6), (4, 7)]  # (predicting position, label)
    expected = sum(torch.nn.functional.cross_entropy(logits[0, i:i + 1], torch.tensor([y])) for i, y in targets)
    assert int(n) == 4
    assert torch.allclose(loss_sum, expected)
    # without packing every shifted label counts
    _, n_unpacked = token_loss_sum(logits, labels, torch.arange(6)[None])
    assert int(n_unpacked) == 5


def test_micro_batch_loss_runs_packed_and_padded_with_checkpointing(make_cfg):
    cfg = make_cfg("debug=fast", "model.gradient_checkpointing=true")
    tokenizer = load_tokenizer(cfg)
    model = build_model(cfg, tokenizer)
    model.train()
    ids = torch.randint(0, len(tokenizer), (2, 10))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(10).repeat(2, 1),
             "attention_mask": torch.ones_like(ids)}
    loss, n = micro_batch_loss(model, batch, torch.device("cpu"))
    loss.backward()
    assert int(n) == 18 and torch.isfinite(loss)
    assert model.model.embed_tokens.weight.grad is not None
    packed = dict(batch, attention_mask=None, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]] * 2))
    loss_packed, n_packed = micro_batch_loss(model, packed, torch.device("cpu"))
    assert int(n_packed) == 16 and torch.isfinite(loss_packed)
    # a loss near log(vocab) at init: the random model knows nothing
    assert abs(float(loss.detach()) - torch.log(torch.tensor(float(len(tokenizer))))) < 1.0


BUILD_IN_A_RANK = """
import sys
from dsrecipes.config.load import compose_and_load, hydra_context
from dsrecipes.modeling.model import build_model, load_tokenizer
with hydra_context():
    cfg = compose_and_load(["debug=fast"], check_files=False)
model = build_model(cfg, load_tokenizer(cfg))
print(type(model).__name__, "scipy" in sys.modules)
from transformers.utils.import_utils import is_scipy_available
try:
    import scipy.optimize
except ImportError:  # not installed (nothing of ours needs it): only the first line can be checked
    print(is_scipy_available(), "absent")
else:
    print(is_scipy_available(), scipy.optimize.linear_sum_assignment.__name__)
"""


def test_a_rank_builds_its_model_without_importing_scipy_and_scipy_still_imports_afterwards():
    """transformers' object-detection losses import scipy.optimize with the modeling code (~1 CPU s per rank);
    model.import_modeling hides scipy for that one import (a fresh interpreter, as a rank starts)."""
    import subprocess
    import sys

    from tests.conftest import subprocess_env

    done = subprocess.run([sys.executable, "-c", BUILD_IN_A_RANK], capture_output=True, text=True, timeout=300,
                          env=subprocess_env())  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    installed = importlib.util.find_spec("scipy") is not None  # the image's, not a dependency of dsrecipes
    after = ["True", "linear_sum_assignment"] if installed else ["False", "absent"]
    assert done.stdout.split() == ["LlamaForCausalLM", "False", *after], done.stdout
