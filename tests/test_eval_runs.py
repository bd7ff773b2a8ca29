"""Evaluation in real runs (CPU, tiny model): `python -m dsrecipes` end to end.

- World size: the step-0 evaluation of the same weights, the tiny model's seeded start, gives the same loss, accuracy
  and token count on 1 rank (built in memory) and on 2 ranks under ZeRO-3 (loaded partitioned from that start
  exported to a local HF directory), where the ranks hold unequal shares (4 and 5 samples: one micro-batch vs two,
  so rank 0 runs a zero-weight forward); the evaluation ledgers prove each of the first `eval_samples` validation
  samples was scored exactly once per evaluation. Prompt-eval during training (5 prompts: 3 and 2 per rank,
  answered with synced ZeRO-3 generation) gives the same scores too. The 2-rank run (a module fixture) is also the
  ZeRO-3 training run: 8 steps from the local directory, its loss falls and its export (through zero_to_fp32)
  reloads with other weights than the base's.
- Model selection: a run tuned to overfit (40 samples, lr 1e-2, constant schedule; one rank inside this process)
  keeps the checkpoint of its lowest eval loss out of retention (keep_checkpoints=1), exports it (recomputed with
  plain transformers: its eval loss is the recorded best), and early stopping ends it; the same run killed mid-save
  while counting patience (a subprocess: the kill ends the process) and restarted ends identically.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
import torch

from tests.conftest import subprocess_env
from tests.test_train_runs import SHORT, assert_hf_model_loads, assert_loss_falls, state_dicts_equal, train_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("evalruns")


def eval_rows(run_dir: Path) -> List[dict]:
    from dsrecipes.core.rundir import read_metrics

    return [r for r in read_metrics(run_dir) if "eval_loss" in r]


def val_rows(run_dir: Path):
    from dsrecipes.data.prepare.build import _open

    stats = json.loads((run_dir / "prepare_stats.json").read_text())
    return _open(Path(stats["cache_dir"]), stats).val


@pytest.fixture(scope="module")
def tiny_hf(workspace) -> Path:
    """The tiny model's seeded start as a local HF directory (the 2-rank ZeRO-3 run's base)."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.rank.export import export_initial

    cfg = compose_and_load(["debug=fast"])
    return export_initial(cfg, load_tokenizer(cfg), workspace / "tiny_hf")


# What both step-0 runs share: the validation split, what is evaluated (at the start and at the end only:
# trainer.eval_every=0) and recorded.
STEP0 = ["dataset.val_size=16", "trainer.eval_samples=9", "trainer.eval_every=0", "trainer.record_samples=true",
         "trainer.report_to=[]", "trainer.prompt_eval_samples=5", "trainer.prompt_eval_max_new_tokens=6"]


@pytest.fixture(scope="module")
def zero3_two_ranks(workspace, tiny_hf) -> Path:
    """2 ranks, ZeRO-3, from the local directory: the 8 steps of SHORT (for the loss and the export), evaluated and
    prompt-evaluated at step 0 and at the end (prompt_eval_every=8: the same two points as the 1-step, 1-rank run's
    prompt_eval_every=1)."""
    run, _ = train_run(workspace, "w2", *STEP0, f"model.path={tiny_hf}", "trainer.prompt_eval_every=8", "zero=stage3",
                       world_size=2)
    return run


def test_zero3_two_ranks_from_a_local_model_directory(zero3_two_ranks, tiny_hf):
    from transformers import AutoModelForCausalLM

    run = zero3_two_ranks
    assert_loss_falls(run)
    exported = assert_hf_model_loads(run / "export")
    assert not state_dicts_equal(exported, AutoModelForCausalLM.from_pretrained(tiny_hf))


def test_step0_eval_is_the_same_on_one_and_two_ranks(zero3_two_ranks, workspace):
    from dsrecipes.rank.evaluation import verify_eval_ledgers

    two = zero3_two_ranks
    one, _ = train_run(workspace, "w1", *STEP0, "trainer.max_steps=1", "trainer.export=false",
                       "trainer.prompt_eval_every=1", world_size=1)  # the tiny model built in memory
    (a, _), (b, _) = eval_rows(one), eval_rows(two)  # step 0, and at the end (after one step; after eight)
    assert a["step"] == b["step"] == 0 and a["eval_tokens"] == b["eval_tokens"] > 0
    assert math.isclose(a["eval_loss"], b["eval_loss"], rel_tol=1e-6), (a, b)
    assert math.isclose(a["eval_accuracy"], b["eval_accuracy"], abs_tol=1e-9), (a, b)
    prompts = ("prompt_exact_match", "prompt_similarity", "prompt_ended", "prompt_count")
    assert a["prompt_count"] == 5 and all(math.isclose(a[k], b[k], abs_tol=1e-9) for k in prompts), (a, b)
    first9 = [i for ids in val_rows(one)["ids"][:9] for i in ids]
    for run, ranks in ((one, 1), (two, 2)):
        assert len(list((run / "ledger").glob("eval_rank*.jsonl"))) == ranks
        assert verify_eval_ledgers(run, first9) == [], run
    from dsrecipes.rank.evaluation import read_eval_ledger

    shares = [read_eval_ledger(two / "ledger" / f"eval_rank{r}.jsonl")[0] for r in (0, 1)]
    assert [len(s) for s in shares] == [4, 5]  # unequal shares: rank 0 padded its second forward


OVERFIT = ["dataset.max_samples=40", "dataset.val_size=8", "data.cutoff_len=128", "optimizer.lr=1e-2",
           "scheduler=constant", "trainer.max_steps=40", "trainer.eval_every=2", "trainer.save_every=2",
           "trainer.keep_checkpoints=1", "trainer.save_best.enabled=true", "trainer.early_stopping.patience=3",
           "trainer.report_to=[]"]


def run_local(workspace: Path, name: str, env=None, expect: int = 0) -> Path:
    """One rank in a subprocess, for the run that is killed (the local launcher runs it in the launching process: a
    kill ends both). The arguments are train_run's, in its order."""
    run_dir = workspace / name
    args = [*SHORT, f"data.cache_dir={workspace / 'cache'}", f"trainer.output_dir={run_dir}",
            f"hydra.run.dir={run_dir}", *OVERFIT, "launcher=local"]
    proc = subprocess.run([sys.executable, "-m", "dsrecipes", *args], env=subprocess_env(env), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == expect, (proc.stdout + proc.stderr)[-6000:]
    return run_dir


def run_here(workspace: Path, name: str) -> Path:
    """One rank inside this process (train_run: no interpreter to start, imports paid once), on one intra-op thread
    like run_local's subprocess (OMP_NUM_THREADS=1, which also keeps distributed.init_distributed from choosing a
    count), so that its numbers and a subprocess's compare step for step on any machine."""
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        try:
            run_dir, _ = train_run(workspace, name, *OVERFIT, world_size=1)
        finally:
            torch.set_num_threads(threads)
    return run_dir


@pytest.fixture(scope="module")
def overfit(workspace) -> Path:
    return run_here(workspace, "overfit")


def hf_eval_loss(model_dir: Path, rows) -> float:
    """Token-weighted validation loss of an exported model, with plain transformers (one row at a time)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["input_ids"]])
            labels = torch.tensor([row["labels"]])[:, 1:]
            logits = model(input_ids=ids).logits[:, :-1]
            mask = labels != -100
            total += float(torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum"))
            count += int(mask.sum())
    return total / count


def test_overfitting_run_keeps_and_exports_its_best_checkpoint_and_stops_early(overfit):
    result = json.loads((overfit / "result.json").read_text())
    evals = eval_rows(overfit)
    trained = [r for r in evals if r["step"] > 0]
    best = min(trained, key=lambda r: r["eval_loss"])
    assert evals[0]["step"] == 0 and result["status"] == "ok"
    assert (result["best_metric"], result["best_step"], result["best_value"]) == ("eval_loss", best["step"],
                                                                                   best["eval_loss"])
    last = evals[-1]["step"]
    assert result["stopped_early"] and last == best["step"] + 3 * 2 < 40, (result, evals)  # patience 3, every 2
    assert result["steps"] == last
    assert sorted(p.name for p in (overfit / "checkpoints").glob("step_*")) == sorted({f"step_{best['step']}",
                                                                                        f"step_{last}"})
    info = json.loads((overfit / "export_best" / "dsrecipes_export.json").read_text())
    assert info["step"] == best["step"]
    rows = val_rows(overfit)
    assert math.isclose(hf_eval_loss(overfit / "export_best", rows), best["eval_loss"], rel_tol=1e-4)
    assert math.isclose(hf_eval_loss(overfit / "export", rows), evals[-1]["eval_loss"], rel_tol=1e-4)


def test_kill_while_counting_patience_then_resume_ends_like_the_uninterrupted_run(overfit, workspace):
    from tests.faults import fault_env

    result = json.loads((overfit / "result.json").read_text())
    kill_at = result["best_step"] + 4  # two evaluations without improvement: the counter is at 2
    run_local(workspace, "killed", env=fault_env(workspace, kill_before_latest=kill_at), expect=17)
    resumed = run_here(workspace, "killed")  # the same run, restarted: trainer.resume=auto
    again = json.loads((resumed / "result.json").read_text())
    keys = ("best_step", "best_value", "stopped_early", "steps")
    assert {k: again[k] for k in keys} == {k: result[k] for k in keys}
    want = [(r["step"], r["eval_loss"]) for r in eval_rows(overfit)]
    got = [(r["step"], r["eval_loss"]) for r in eval_rows(resumed)]
    assert [s for s, _ in got] == [s for s, _ in want]
    assert all(math.isclose(x, y, rel_tol=1e-6) for (_, x), (_, y) in zip(got, want)), (got, want)
