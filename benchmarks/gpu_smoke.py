"""GPU smoke test: throughput and MFU of a ~0.5B Qwen2-style model under ZeRO-2 and ZeRO-3 on one GPU.

    python benchmarks/gpu_smoke.py --out smoke_out            # (launch/gpu_smoke.sh wraps this)
    python benchmarks/gpu_smoke.py --out /tmp/s --tiny --device cpu --steps 6 --pipeline-steps 4   # CPU self-test
    python benchmarks/gpu_smoke.py --smoke      # tiny, both modes, ZeRO-2; on CPU (and says so) when no GPU is there

Two modes, each run once per ZeRO stage in its own child process (a hang or crash costs one phase, not the run):
  direct    a randomly initialised Qwen2.5-0.5B-shaped model (config built here, no hub), bf16, trained with
            `deepspeed.initialize` on the DeepSpeed JSON from dsrecipes' own builder (`build_ds_config`), on a fixed
            pool of random token batches (so the loss must fall). Reports tokens/s, MFU, peak GPU memory.
  pipeline  the whole framework: `python -m dsrecipes` with the embedded model sized like Qwen2.5-0.5B (the bundled
            tokenizer's small vocabulary), packed sample data, launcher=deepspeed on 1 GPU; reads metrics.jsonl.
MFU = 6 * N * tokens/s / peak, N = all parameters, peak = --peak-tflops (989 = H100/H200 dense bf16).
Everything lands in OUT/results.json (plus one JSON per phase); exit code 0 only when every phase passed.
A total time budget (--budget-s) skips phases that could not finish in time, so the script ends in about 5 minutes.
`--smoke`: the tiny model, a few steps, ZeRO-2 only, both modes, on the GPU when there is one, else on CPU in fp32
(pipeline mode with launcher=local) with notes on the output and in results.json's `notes` (--out defaults to a fresh
temporary directory then).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import _harness  # noqa: F401  (this checkout on sys.path and PYTHONPATH: the dsrecipes beside it is measured)

from dsrecipes.core.metrics_file import mean_rate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QWEN2_0_5B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
)
TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=2048, tie_word_embeddings=True, rope_theta=10_000.0)  # fmt: skip


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="directory for results.json and per-phase files (required unless --smoke)")
    p.add_argument("--smoke", action="store_true", help="tiny, seconds: every phase runs (on CPU when no GPU)")
    p.add_argument("--stages", default="2,3", help="ZeRO stages, comma-separated")
    p.add_argument("--modes", default="direct,pipeline", help="direct, pipeline, or both")
    p.add_argument("--steps", type=int, default=100, help="direct mode: optimizer steps (first --warmup not timed)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--pipeline-steps", type=int, default=50)
    p.add_argument("--micro-batch", type=int, default=16, help="per step (16 x 1024: 56 GiB peak on ZeRO-2)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of one GPU (H100/H200: 989)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="a tiny model (self-test of this script on CPU)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a dsrecipes override for both modes, repeatable (e.g. optimizer.torch_adam=false)")
    p.add_argument("--budget-s", type=float, default=280.0, help="skip phases that would start after this")
    p.add_argument("--phase-timeout-s", type=float, default=150.0)
    p.add_argument("--child", choices=["direct"], help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.notes = []
    args.launcher = ["launcher=deepspeed", "launcher.num_gpus=1"]  # pipeline mode's launcher
    if args.out is None and not args.smoke:
        p.error("--out is required (unless --smoke)")
    if args.smoke and args.child is None:
        smoke_settings(args)
    return args


def smoke_settings(args: argparse.Namespace) -> None:
    """--smoke: tiny sizes; on CPU (fp32) when this machine has no CUDA GPU, with a note saying so."""
    import tempfile

    import torch

    args.tiny, args.stages, args.steps, args.warmup, args.pipeline_steps = True, "2", 16, 2, 4
    args.micro_batch, args.seq, args.budget_s, args.phase_timeout_s = 2, 64, 280.0, 150.0
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="gpu_smoke_")
    if not torch.cuda.is_available():
        args.device, args.precision = "cpu", "fp32"
        args.notes.append("smoke: no CUDA GPU on this machine, so the tiny model runs on CPU in fp32; nothing here "
                          "says anything about a GPU")
        args.launcher = ["launcher=local"]  # two fewer processes (DeepSpeed's launcher, a rank) each importing torch
        args.notes.append("smoke: pipeline mode runs `python -m dsrecipes` with launcher=local (its rank in the CLI's "
                          "process), not launcher=deepspeed on 1 GPU")
    for note in args.notes:
        print(f"NOTE: {note}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# direct mode (child process)


def run_direct(args: argparse.Namespace) -> Dict[str, Any]:
    """A random Qwen2-shaped model in a bare deepspeed.initialize loop: step time, tokens/s, MFU, peak memory."""
    import torch

    from dsrecipes.core.deepspeed_import import load_deepspeed

    deepspeed = load_deepspeed()  # the first import, as in dsrecipes processes (no autotuner mlflow import)
    t_start = time.time()
    engine, n_params, vocab, ds_config = _direct_engine(args)
    timed, elapsed, all_losses = _timed_steps(args, engine, vocab)
    tokens_per_s = timed * args.micro_batch * args.seq / elapsed
    cycle = min(POOL, len(all_losses) // 2) or 1
    # the same batches come back every POOL steps: the last pass over them must beat the first
    first, last = sum(all_losses[:cycle]) / cycle, sum(all_losses[-cycle:]) / cycle
    return {
        "mode": "direct", "stage": args.stage, "ok": last < first, "params": n_params,
        "steps": args.steps, "timed_steps": timed, "micro_batch": args.micro_batch, "seq": args.seq,
        "step_time_s": elapsed / timed, "tokens_per_s": tokens_per_s,
        "mfu": 6 * n_params * tokens_per_s / (args.peak_tflops * 1e12), "peak_tflops": args.peak_tflops,
        "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None,
        "loss_first": first, "loss_last": last, "losses": all_losses[:: max(len(all_losses) // 30, 1)],
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "optimizer": f"{type(engine.basic_optimizer).__name__} in {type(engine.optimizer).__name__}",
        "overrides": args.override, "ds_optimizer": ds_config["optimizer"],
        "torch": torch.__version__, "deepspeed": deepspeed.__version__, "wall_s": time.time() - t_start,
        "note": None if last < first else "loss did not fall on a repeated batch pool",
    }  # fmt: skip


POOL = 8  # distinct random batches, cycled


def _direct_engine(args: argparse.Namespace) -> Tuple[Any, int, int, Dict[str, Any]]:
    """(engine, parameters, vocabulary size, the DeepSpeed JSON) with the DeepSpeed JSON dsrecipes generates for these settings."""
    import deepspeed
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dsrecipes.config.defaults import learning_rate
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.distributed import skip_shm_comm_op
    from dsrecipes.rank.schedule import StepScheduler
    from dsrecipes.run.ds_config import build_ds_config

    overrides = [
        f"zero=stage{args.stage}", f"precision={args.precision}", f"trainer.micro_batch_size={args.micro_batch}",
        "trainer.grad_accum=1", f"trainer.max_steps={args.steps}", f"scheduler.warmup_steps={args.warmup}",
        "optimizer.lr=3e-4", f"data.cutoff_len={args.seq}", f"trainer.device={args.device}", *args.override,
    ]  # fmt: skip
    cfg = compose_and_load(overrides, check_files=False)
    ds_config = build_ds_config(cfg, world_size=1)
    shape = TINY if args.tiny else QWEN2_0_5B
    config = Qwen2Config(
        **shape, max_position_embeddings=max(args.seq, 2048), attn_implementation="sdpa", use_cache=False
    )
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Qwen2ForCausalLM(config).to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    if args.device == "cpu":  # as dsrecipes ranks train on CPU: no shared-memory all-reduce op (a cold JIT build)
        skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    schedule = lambda opt: StepScheduler(opt, cfg.scheduler, learning_rate(cfg), args.steps)  # noqa: E731 (as train.py)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                           lr_scheduler=schedule)
    return engine, n_params, config.vocab_size, ds_config


def _timed_steps(args: argparse.Namespace, engine: Any, vocab: int) -> Tuple[int, float, List[float]]:
    """(timed steps, their seconds, every step's loss): steps after `args.warmup` are timed."""
    import torch

    gen = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, vocab, (args.micro_batch, args.seq), generator=gen).to(engine.device)
            for _ in range(POOL)]  # fmt: skip
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    loss_tensors = []  # kept on the device: reading each loss would synchronise every step
    t0 = time.time()
    for step in range(args.steps):
        if step == args.warmup:
            sync()
            t0 = time.time()
        batch = pool[step % len(pool)]
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        loss_tensors.append(loss.detach())
    sync()
    return max(args.steps - args.warmup, 1), time.time() - t0, [float(t.float().item()) for t in loss_tensors]


# ---------------------------------------------------------------------------------------------------------------
# pipeline mode (runs `python -m dsrecipes` in a child process)


def pipeline_overrides(args: argparse.Namespace, stage: int, run_dir: Path) -> List[str]:
    shape = TINY if args.tiny else QWEN2_0_5B
    return [
        f"zero=stage{stage}", f"precision={args.precision}", f"trainer.device={args.device}",
        f"model.tiny.hidden_size={shape['hidden_size']}", f"model.tiny.intermediate_size={shape['intermediate_size']}",
        f"model.tiny.num_hidden_layers={shape['num_hidden_layers']}",
        f"model.tiny.num_attention_heads={shape['num_attention_heads']}",
        f"model.tiny.num_key_value_heads={shape['num_key_value_heads']}",
        f"model.tiny.max_position_embeddings={max(args.seq, 2048)}",
        "data.packing=true", f"data.cutoff_len={args.seq}", f"trainer.micro_batch_size={args.micro_batch}",
        f"trainer.max_steps={args.pipeline_steps}", f"trainer.log_every={max(args.pipeline_steps // 10, 1)}",
        f"scheduler.warmup_steps={max(args.pipeline_steps // 10, 1)}", f"trainer.eval_samples={2 * args.micro_batch}",
        "trainer.export=false", *args.launcher, f"trainer.output_dir={run_dir}", *args.override,
    ]  # fmt: skip


def run_pipeline(args: argparse.Namespace, stage: int, out: Path, timeout: float) -> Dict[str, Any]:
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.run.estimate import model_shape

    run_dir = out / f"pipeline_stage{stage}_run"
    overrides = pipeline_overrides(args, stage, run_dir)
    n_params = model_shape(compose_and_load(overrides, check_files=False)).total_params
    t0 = time.time()
    log = out / f"pipeline_stage{stage}.log"
    with open(log, "w") as fh:
        try:
            code = subprocess.run([sys.executable, "-m", "dsrecipes", *overrides], cwd=REPO, stdout=fh,
                                  stderr=subprocess.STDOUT, timeout=timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = "timeout"
    rows = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "loss" in r and r.get("tokens_per_s")]
    # the later half (warm-up and compilation excluded): its windows' tokens over their time (mean_rate leaves out
    # the first window it is given, the one before that half)
    tokens_per_s = mean_rate(train[max(len(train) // 2 - 1, 0):])
    ok = code == 0 and len(train) > 1 and train[-1]["loss"] < train[0]["loss"]
    return {
        "mode": "pipeline", "stage": stage, "ok": ok, "exit_code": code, "params": n_params,
        "micro_batch": args.micro_batch, "seq": args.seq, "overrides": args.override,
        "steps": train[-1]["step"] if train else 0, "tokens_per_s": tokens_per_s,
        "mfu": 6 * n_params * tokens_per_s / (args.peak_tflops * 1e12) if tokens_per_s else None,
        "loss_first": train[0]["loss"] if train else None, "loss_last": train[-1]["loss"] if train else None,
        "wall_s": time.time() - t0, "log": str(log), "run_dir": str(run_dir),
        "note": None if ok else f"see {log} (last lines below)", "log_tail": None if ok else _tail(log),
    }  # fmt: skip


def _tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.is_file() else ""


# ---------------------------------------------------------------------------------------------------------------
# parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_argv(args: argparse.Namespace) -> List[str]:
    """The settings a direct-mode child needs, spelled out (--smoke resolved here, not again in the child)."""
    argv = ["--out", str(args.out), "--steps", str(args.steps), "--warmup", str(args.warmup), "--micro-batch",
            str(args.micro_batch), "--seq", str(args.seq), "--peak-tflops", str(args.peak_tflops), "--precision",
            args.precision, "--device", args.device, *(["--tiny"] if args.tiny else [])]
    return argv + [a for o in args.override for a in ("--override", o)]


def run_direct_child(
    args: argparse.Namespace, stage: int, out: Path, timeout: float
) -> Dict[str, Any]:
    result_file = out / f"direct_stage{stage}.json"
    log = out / f"direct_stage{stage}.log"
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(REPO)}  # fmt: skip
    t0 = time.time()
    with open(log, "w") as fh:
        try:
            argv = [sys.executable, __file__, *child_argv(args), "--child", "direct", "--stage", str(stage)]
            code = subprocess.run(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code == 0 and result_file.is_file():
        return json.loads(result_file.read_text())
    return {"mode": "direct", "stage": stage, "ok": False, "exit_code": code, "wall_s": time.time() - t0,
            "log": str(log), "log_tail": _tail(log)}  # fmt: skip


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.child == "direct":
        result = run_direct(args)
        (out / f"direct_stage{args.stage}.json").write_text(json.dumps(result, indent=2))
        return 0
    start = time.time()
    stages = [int(s) for s in args.stages.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    results = []
    for mode in ("direct", "pipeline"):
        if mode not in modes:
            continue
        for stage in stages:
            left = args.budget_s - (time.time() - start)
            if left < 45:  # too little time for a phase to start, train and report
                results.append({"mode": mode, "stage": stage, "ok": False, "note": "skipped: time budget spent"})
                continue
            timeout = min(args.phase_timeout_s, left)
            print(f"[gpu_smoke] {mode} ZeRO-{stage} (timeout {timeout:.0f}s) ...", flush=True)
            if mode == "direct":
                r = run_direct_child(args, stage, out, timeout)
            else:
                r = run_pipeline(args, stage, out, timeout)
            (out / f"{mode}_stage{stage}.json").write_text(json.dumps(r, indent=2))
            results.append(r)
            print("[gpu_smoke]   " + _line(r), flush=True)
    summary = {"ok": all(r["ok"] for r in results), "wall_s": time.time() - start, "args": vars(args),
               "smoke": args.smoke, "notes": args.notes, "results": results}  # fmt: skip
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print(f"\n[gpu_smoke] {'PASS' if summary['ok'] else 'FAIL'} in {summary['wall_s']:.0f}s -> {out / 'results.json'}")
    for r in results:
        print("  " + _line(r))
    return 0 if summary["ok"] else 1


def _line(r: Dict[str, Any]) -> str:
    def f(key: str, fmt: str) -> str:
        return format(r[key], fmt) if r.get(key) is not None else "-"

    status = "ok" if r["ok"] else "FAILED"
    return (f"{r['mode']:<8} ZeRO-{r['stage']} {status:<6} tokens/s {f('tokens_per_s', '.0f')}  MFU {f('mfu', '.1%')}  "
            f"peak {f('peak_mem_mb', '.0f')} MB  loss {f('loss_first', '.3f')} -> {f('loss_last', '.3f')}  "
            f"wall {f('wall_s', '.0f')}s" + (f"  ({r['note']})" if r.get("note") else ""))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
