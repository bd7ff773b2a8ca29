"""Real training runs on CPU through `python -m dsrecipes`: 2 ranks under the deepspeed launcher (gloo) in a
subprocess, 1 rank with the local launcher inside this process (as Hydra would run it; imports are paid once).

One run per configuration, each checking several things, to keep the file within a few CPU minutes:
  ZeRO-2, 2 ranks: loss falls, metrics/TensorBoard/plot/ledger, checkpoints + latest, export reloads
  ZeRO-2, 2 ranks, one run through three interruptions (tests/test_signals.py: helpers): SIGTERM to the launching
      process: every rank checkpoints the same step, nothing is left running; SIGKILL to the launching process of
      the resumed run: its ranks checkpoint and stop by themselves; killed mid-save, then the same command: resumes
      from the last good checkpoint; the losses equal the uninterrupted run's step for step
  ZeRO-2 checkpoint of 2 ranks resumed on 1 rank (universal checkpoint conversion)
  (ZeRO-3, 2 ranks, from a local HF directory: in tests/test_eval_runs.py, whose step-0 evaluation run it is)
  ZeRO-0 (1 rank) then ZeRO-1 bf16 and ZeRO-2 + CPU optimizer offload in the same process (re-entrant runs);
      `dsrecipes export` CLI from a tag
  LoRA (1 rank): merged export == base + adapter; adapter-only export
  prompt-eval: the trained model predicts the references better than its seeded start
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Tuple

import pytest
import torch

from tests.conftest import in_process_environ, subprocess_env

pytestmark = pytest.mark.slow

SHORT = [
    "debug=fast",  # 8 steps, micro batch 4, save/eval every 4, cutoff 192, 400 samples, 16 for validation
    "trainer.log_every=1",
    "optimizer.lr=3e-3",
    "dataset.max_samples=240",
    "data.cutoff_len=96",
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def train_run(workspace: Path, name: str, *overrides: str, world_size: int = 2, env: Optional[dict] = None,
              expect_ok: bool = True) -> Tuple[Path, str]:
    """`python -m dsrecipes` end to end (compose, prepare, run dir, launcher, ranks) in `workspace/name`."""
    run_dir = workspace / name
    args = [*SHORT, f"data.cache_dir={workspace / 'cache'}", f"trainer.output_dir={run_dir}",
            f"hydra.run.dir={run_dir}", *overrides]
    if world_size == 1:
        assert env is None
        return run_dir, _in_process(args + ["launcher=local"], expect_ok)
    argv = [sys.executable, "-m", "dsrecipes", *args, "launcher=deepspeed", f"launcher.num_gpus={world_size}"]
    proc = subprocess.run(argv, env=subprocess_env(env), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == expect_ok, out[-6000:]
    return run_dir, out


def _in_process(args: List[str], expect_ok: bool) -> str:
    from dsrecipes.cli import main

    with in_process_environ():
        code = main(args)
    assert (code == 0) == expect_ok
    return ""


def metrics(run_dir: Path) -> List[dict]:
    from dsrecipes.core.rundir import read_metrics

    return read_metrics(run_dir)


def train_losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def assert_loss_falls(run_dir: Path, by: float = 0.3) -> None:
    losses = train_losses(run_dir)
    steps = sorted(losses)
    assert losses[steps[-1]] < losses[steps[0]] - by, losses


def assert_hf_model_loads(path: Path, vocab_size: Optional[int] = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    return model


def state_dicts_equal(a: torch.nn.Module, b: torch.nn.Module, atol: float = 0.0) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.allclose(sa[k].float(), sb[k].float(), atol=atol) for k in sa)


# ---------------------------------------------------------------------------------------------------------------


RECORDED = ("zero=stage2", "trainer.record_samples=true")


@pytest.fixture(scope="module")
def zero2_run(workspace) -> Path:
    # from an empty extensions cache (this run needs no op): test_two_rank_training_builds_no_shared_memory_op
    fresh = {"XDG_CACHE_HOME": str(workspace / "zero2_cache"), "TORCH_EXTENSIONS_DIR": None}
    run_dir, out = train_run(workspace, "zero2", *RECORDED, env=fresh)
    (workspace / "zero2.console").write_text(out)  # what the user saw (stdout + stderr)
    return run_dir


def test_two_rank_console_has_lines_a_summary_and_no_launcher_noise(zero2_run, workspace):
    shown = (workspace / "zero2.console").read_text()
    assert "\r" not in shown and "step 8/8  loss " in shown and f"  run dir      {zero2_run}\n" in shown
    for noise in ("Setting accelerator to CPU", "[INFO] [launch.py", "[INFO] [runner.py", "Unable to find hostfile",
                  "Attempting to get learning rate", "FutureWarning"):
        assert noise not in shown, noise
    logs = "".join(p.read_text() for p in (zero2_run / "logs").glob("*.log"))
    assert "Setting accelerator to CPU" in logs and "[INFO] [launch.py" in logs
    assert {p.name for p in (zero2_run / "logs").glob("*.log")} >= {"launcher.log", "rank0.log", "rank1.log"}


def test_zero2_two_ranks_trains_logs_checkpoints_and_exports(zero2_run):
    from dsrecipes.data.plan.ledger import verify_ledgers

    run = zero2_run
    assert_loss_falls(run)
    lines = metrics(run)
    train = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    assert all(r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and r["lr"] >= 0 for r in train)
    assert max(r["lr"] for r in train) > 0
    assert train[-1]["samples_seen"] == 8 * 4 * 2  # steps x micro batch x ranks (no packing)
    assert [r["step"] for r in lines if "eval_loss" in r] == [0, 4, 8]  # the starting weights first
    assert list((run / "tb").glob("events.out.tfevents.*")) and (run / "loss.png").stat().st_size > 1000
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_8"
    for tag in ("step_4", "step_8"):
        assert (ckpts / tag / "complete.json").is_file()
        for rank in (0, 1):
            assert (ckpts / tag / "data_state" / f"rank{rank}.json").is_file()
            assert (ckpts / tag / "rng" / f"rank{rank}.pt").is_file()
    verify_ledgers(run)
    exported = assert_hf_model_loads(run / "export")
    initial = assert_hf_model_loads(run / "export_init")
    assert not state_dicts_equal(exported, initial)
    port = re.search(r"--master_port[= ](\d+)", (run / "launch.txt").read_text()).group(1)
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))  # the ranks' shm segments


def test_two_rank_training_builds_no_shared_memory_op(zero2_run, workspace):
    """Training over gloo does not use DeepSpeed's shm op (dsrecipes.core.jit_ops): the 2-rank run, started from an
    empty extensions cache, trained (test_zero2_...) and built nothing, and DeepSpeed's runner was not started."""
    cache = workspace / "zero2_cache"
    assert cache.is_dir()  # the run's processes used it (matplotlib keeps its font cache there)
    assert not list(cache.rglob("*shm_comm*")), "the shm op was built"
    assert not list(cache.rglob("*.so")), list(cache.rglob("*.so"))
    assert "building DeepSpeed" not in (workspace / "zero2.console").read_text()
    launched = (zero2_run / "launch.txt").read_text()  # one machine: DeepSpeed's per-node launcher, no runner first
    assert " -u -m dsrecipes.run.launch.ds_node --world_info=" in launched and "deepspeed.launcher.runner" not in launched


def test_sigterm_reaches_every_rank_a_killed_launcher_leaves_no_rank_behind_and_a_death_mid_save_resumes(
        zero2_run, workspace):  # fmt: skip
    """One 2-rank run through three interruptions, then compared with the uninterrupted run step for step:
    SIGTERM at step 2 (checkpoint at 3, the printed command resumes), the launching process killed outright at step
    5 (the ranks checkpoint at 6 and stop), and a death while saving the final step-8 checkpoint (after the files,
    before `latest`): the same command resumes from step 6, the last good one."""
    import signal

    from dsrecipes.data.plan.ledger import verify_ledgers
    from tests.faults import fault_env
    from tests.test_signals import (
        assert_interrupted_at,
        finish,
        log_of,
        losses,
        no_process_left,
        resume,
        start,
        wait_for_step,
    )

    run, two_ranks = workspace / "signalled", (*RECORDED, "launcher=deepspeed", "launcher.num_gpus=2")
    proc = start(workspace, run, *two_ranks, pause_after=2)
    wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGTERM)
    command = assert_interrupted_at(workspace, run, finish(proc), signal.SIGTERM)
    no_process_left(run, within=5)  # the launching process returns only once its whole process group is gone

    # The resumed run's launching process is killed outright (no handler runs): its ranks must not train on alone.
    proc = start(workspace, run, *two_ranks, pause_after=5)
    wait_for_step(run, 5, proc)
    proc.kill()
    finish(proc)
    no_process_left(run, within=120)
    assert (run / "checkpoints" / "step_6" / "complete.json").is_file()  # checkpointed at the next boundary
    assert json.loads((run / "rank_outcome.json").read_text())["stopped_at_step"] == 6

    ckpts = run / "checkpoints"
    resume(workspace, run, command, env=fault_env(workspace, kill_before_latest=8), expect_ok=False)  # dies saving step 8
    assert (ckpts / "latest").read_text() == "step_6"
    assert (ckpts / "step_8.partial").is_dir() and not (ckpts / "step_8").exists()  # written beside, never renamed
    assert max(losses(run)) == 8  # it trained to the end, then died while saving
    seen = len(log_of(workspace, run))
    resume(workspace, run, command)  # the same command again: trainer.resume=auto
    assert f"resumed from {ckpts / 'step_6'}" in log_of(workspace, run)[seen:]
    assert (ckpts / "latest").read_text() == "step_8" and (ckpts / "step_8" / "complete.json").is_file()
    assert losses(run) == train_losses(zero2_run)  # exact, step for step
    evals = lambda r: [(x["step"], x["eval_loss"]) for x in metrics(r) if "eval_loss" in x]  # noqa: E731
    assert evals(run) == evals(zero2_run)
    verify_ledgers(run)


def test_elastic_resume_of_a_two_rank_zero2_checkpoint_on_one_rank(zero2_run, workspace):
    step_4 = zero2_run / "checkpoints" / "step_4"
    run, _ = train_run(workspace, "elastic", *RECORDED, f"trainer.resume_from={step_4}", world_size=1)
    assert (step_4 / "universal" / "complete.json").is_file()  # converted once by ds_to_universal
    losses, reference = train_losses(run), train_losses(zero2_run)
    assert sorted(losses) == [5, 6, 7, 8]
    # weights and optimizer state carried over (a fresh model would be back near 7.7); the batches differ
    assert abs(losses[5] - reference[5]) < 0.3 and losses[8] < losses[5]


@pytest.mark.timeout(1800)  # may pay the session's cold CPU Adam build (conftest.built_cpu_adam)
def test_one_process_zero0_zero1_bf16_zero2_offload_and_export_cli(workspace, built_cpu_adam, monkeypatch):
    from dsrecipes.cli import main as cli

    run, _ = train_run(workspace, "zero0", "zero=stage0", world_size=1)
    assert_loss_falls(run)
    assert_hf_model_loads(run / "export")

    run, _ = train_run(workspace, "zero1_bf16", "zero=stage1", "precision=bf16", "trainer.export=false",
                       world_size=1)
    assert_loss_falls(run)
    assert not (run / "export").exists()
    assert cli(["export", str(run), "--tag", "step_4", "--out", str(run / "exported_4")]) == 0
    model = assert_hf_model_loads(run / "exported_4")
    assert model.dtype == torch.bfloat16
    assert json.loads((run / "exported_4" / "dsrecipes_export.json").read_text())["step"] == 4

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(built_cpu_adam[2]))  # the session's one CPU Adam build
    run, _ = train_run(workspace, "zero2_offload", "zero=stage2", "offload=cpu_optimizer", world_size=1)
    assert_loss_falls(run)
    assert_hf_model_loads(run / "export")


def test_lora_merged_and_adapter_exports(workspace):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dsrecipes.cli import main as cli

    run, _ = train_run(workspace, "lora", "model.lora.enabled=true", "optimizer.lr=1e-2", world_size=1)
    assert_loss_falls(run, by=0.05)
    merged = assert_hf_model_loads(run / "export")
    assert not any("lora" in k for k in merged.state_dict())
    assert cli(["export", str(run), "--lora", "adapter", "--out", str(run / "adapter")]) == 0
    assert (run / "adapter" / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(run / "export_init")
    with_adapter = PeftModel.from_pretrained(base, run / "adapter").eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert torch.allclose(with_adapter(input_ids=ids).logits, merged.eval()(input_ids=ids).logits, atol=1e-4)
    # The adapter names its base (the tiny model's start), so stock peft, prompt-eval and chat all load it.
    from peft import AutoPeftModelForCausalLM

    assert json.loads((run / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        (run / "export_init").resolve())
    auto = AutoPeftModelForCausalLM.from_pretrained(run / "adapter").eval()
    assert torch.allclose(auto(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4)
    for finetuned in (run / "adapter", run / "export", run):  # adapter-only, merged, the run directory
        assert cli(["prompt-eval", "--finetuned", str(finetuned), "--baseline", str(run), "--limit", "2",
                    "--max-new-tokens", "4"]) == 0
    assert cli(["chat", str(run / "adapter"), "--message", "What is 2 + 3?", "--max-new-tokens", "8"]) == 0


def test_prompt_eval_finetuned_beats_its_start(zero2_run, tmp_path, capsys):
    from dsrecipes.cli import main as cli

    out = tmp_path / "scores.json"
    assert cli(["prompt-eval", "--baseline", str(zero2_run), "--finetuned", str(zero2_run),
                "--max-new-tokens", "8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "baseline: greedy" in printed and "finetuned: greedy" in printed and "==========score" in printed
    scores = json.loads(out.read_text())
    assert scores["finetuned"]["reference_loss"] < scores["baseline"]["reference_loss"] - 0.5
    assert scores["finetuned"]["similarity"] >= scores["baseline"]["similarity"]
