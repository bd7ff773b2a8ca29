"""Side by side on one GPU: dsrecipes' default recipe against TRL's SFTTrainer (best documented settings and plain
defaults) and a bare DeepSpeed loop, same model, data, sequence length and tokens per optimizer step (issue 46).

    python benchmarks/gpu_compare.py                       # one H200/H100, no network: about 8 minutes
    python benchmarks/gpu_compare.py --smoke --out DIR     # CPU dry run of every code path: tiny model, 2 steps

Rows: a Qwen2.5-1.5B- and a Qwen2.5-0.5B-shaped random model (config only, written once as a local model directory
with the bundled tokenizer) x ZeRO-2 and ZeRO-3, in this order (1.5B ZeRO-2 first: the MFU target); a run that
would start after --budget-s is skipped and said so (a started run ends within --run-timeout-s). Each cell runs
these systems, each as a user starts it, in its own process, the order reversed from one cell to the next (A/B, B/A):
  dsrecipes         `python -m dsrecipes` (launcher=deepspeed): the default recipe, only model/data/sizes/ZeRO set;
  dsrecipes_levers  the same plus the issue-46 levers (data.packing=true, trainer.ce_chunk_tokens=4096,
                    flash_attention_2 where flash-attn is installed): a lever becomes a default only where it wins;
  trl_best          `deepspeed _trl_sft.py --deepspeed DS.json`: packing, padding_free, use_liger_kernel and
                    flash_attention_2 where installed, no gradient checkpointing, bf16; DS.json is dsrecipes' ZeRO
                    JSON with the HF-owned values "auto" (HF's guide), optimizer values as HF flags (the same);
  trl_best_flex     TRL best on flex_attention: run by default on a GPU without flash-attn, where TRL best's
                    padding-free batch on sdpa is TRL's slow path; "TRL best" in the table is the faster of the two
  trl_plain         the same launch with TRL's defaults (no packing, padded batches, gradient checkpointing on);
  bare              a bare `deepspeed.initialize` loop on random batches of the same shape (micro_batch x seq),
                    the floor: gpu_idle_s_per_step = a dsrecipes step's time minus the bare loop's for its tokens.
Tokens per optimizer step = micro_batch x grad_accum x seq everywhere (--trl-micro-batch: TRL best's own micro-batch,
its grad_accum then keeps the product; unpacked systems pad, so they train fewer real tokens a step: tokens/s counts
real tokens everywhere). Each system's tokens/s is over its steps after the first third. Peak memory: the largest
`nvidia-smi` memory.used seen while the process ran (the same for every system). MFU = (6 N + 12 L d T) x tokens/s
/ peak (N all parameters, L layers, d hidden size, T seq: attention FLOPs counted as PaLM does, full T x T).
Writes OUT/compare.json (a list of rows {system, model, params, zero, micro_batch, seq_len, tokens_per_s, mfu,
peak_mem_gib, settings, ...}), OUT/compare.png and OUT/gpu_compare.json (the harness' result: arguments, notes,
rows), and prints the ratio table. --out defaults to benchmarks/results/<date>_<device>.
Every system alike (benchmarks/_compare_rows.py): a run's tokens/s counts only when it exited 0 after all its steps
(a failed one is `fail` in the table and the plot, never a number from its first windows or a bar of 0), and a run
that ran out of GPU memory runs again at half the micro-batch and twice the accumulation (same tokens per step).
--smoke without a GPU runs every system through the same argument builders inside this process instead of its own
(dsrecipes with launcher=local, TRL's HF Trainer with the same DS.json on DeepSpeed's CPU accelerator): seconds.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import _harness
from _compare_rows import SYSTEMS, counted, log_every, plot, ratio_table, timed_after, with_oom_retries
from _run_system import free_port, rank_env, run_child
from _sharegpt_corpus import write_corpus

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
TOKENIZER = REPO / "dsrecipes" / "assets" / "tiny_tokenizer"
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2176, tie_word_embeddings=True),  # the bundled tokenizer: 2113
}
LEVERS = ["data.packing=true", "trainer.ce_chunk_tokens=4096"]
ROW_KEYS = ("system", "model", "params", "zero", "micro_batch", "seq_len", "tokens_per_s", "mfu", "peak_mem_gib",
            "settings")
HF_AUTO = ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps", "gradient_clipping")


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = _harness.add_args(argparse.ArgumentParser(description=__doc__,
                                                  formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--models", default="qwen2.5-1.5b,qwen2.5-0.5b")
    p.add_argument("--zero", default="2,3")
    p.add_argument("--systems", default=None, help="default: all, trl_best_flex only on a GPU without flash-attn")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8, help="dsrecipes' and the bare loop's micro-batch")
    p.add_argument("--trl-micro-batch", type=int, default=8, help="TRL best: the largest that fits (found before)")
    p.add_argument("--trl-attn", default="auto", choices=["auto", "flash_attention_2", "sdpa", "flex_attention"],
                   help="TRL best's attention (auto: flash_attention_2 where flash-attn is installed, else sdpa)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--budget-s", type=float, default=360.0, help="runs that would start later are skipped (noted)")
    p.add_argument("--run-timeout-s", type=float, default=120.0)
    p.add_argument("--corpus-mb", type=float, default=8.0)
    args = p.parse_args(argv)
    args.cuda = _cuda()
    if args.systems is None:
        flex = args.cuda and args.trl_attn == "auto" and importlib.util.find_spec("flash_attn") is None
        args.systems = ",".join(s for s in SYSTEMS if flex or s != "trl_best_flex")
    if args.smoke:
        args.models, args.zero, args.seq, args.micro_batch, args.trl_micro_batch = "tiny", "2", 64, 2, 1
        args.steps, args.corpus_mb, args.budget_s = 2, 0.03, 300.0
    if (args.micro_batch * args.grad_accum) % args.trl_micro_batch:
        p.error(f"--trl-micro-batch {args.trl_micro_batch} must divide micro_batch x grad_accum "
                f"({args.micro_batch} x {args.grad_accum}): the tokens per optimizer step are the same everywhere")
    args.trl_grad_accum = args.micro_batch * args.grad_accum // args.trl_micro_batch
    args.in_process = args.smoke and not args.cuda
    return args


def _cuda() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


def default_out(cuda: bool) -> Path:
    device = "cpu"
    if cuda:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout.strip().splitlines()[0]
        device = name.lower().replace("nvidia ", "").replace(" ", "_")
    return HERE / "results" / f"{datetime.date.today().isoformat()}_{device}"


def write_model(name: str, root: Path, seq: int) -> Path:
    """A randomly initialised Qwen2 model directory of the shape (bf16 weights) with the bundled tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = root / f"model_{name}"
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config = Qwen2Config(**SHAPES[name], max_position_embeddings=max(seq, 4096), rope_theta=1e6, use_cache=False)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, path / f.name)
    return path


def flops_per_token(name: str, params: int, seq: int) -> float:
    s = SHAPES[name]
    return 6 * params + 12 * s["num_hidden_layers"] * s["hidden_size"] * seq


def run(args, argv: List[str], log: Path, env: Optional[Dict[str, str]] = None):
    return run_child(argv, log, in_process=args.in_process, cuda=args.cuda, timeout_s=args.run_timeout_s, env=env)


def ds_overrides(args: argparse.Namespace, model: Path, zero: int, data: str, run_dir: Path,
                 sizes: Optional[tuple] = None) -> List[str]:
    launcher = ["launcher=local"] if args.in_process else ["launcher=deepspeed", "launcher.num_gpus=1"]
    hw = ["precision=bf16"] if args.cuda else ["precision=fp32", "trainer.device=cpu"]
    mb, accum = sizes or (args.micro_batch, args.grad_accum)
    return [f"model.path={model}", "dataset=sharegpt_files", f"dataset.paths=[{data}]", f"zero=stage{zero}",
            f"data.cutoff_len={args.seq}", f"trainer.micro_batch_size={mb}",
            f"trainer.grad_accum={accum}", f"trainer.max_steps={args.steps}",
            f"trainer.log_every={log_every(args.steps)}", "trainer.eval_every=0", "trainer.eval_at_start=false",
            "trainer.export=false", "trainer.report_to=[]", f"trainer.output_dir={run_dir}",
            f"data.cache_dir={run_dir.parent.parent / 'dsrecipes_cache'}", *hw, *launcher]


def levers(args: argparse.Namespace) -> List[str]:
    flash = args.cuda and importlib.util.find_spec("flash_attn") is not None
    return LEVERS + (["model.attn_implementation=flash_attention_2"] if flash else [])


def attempt_dir(base: Path, name: str, mb: int, accum: int, first: tuple) -> Path:
    """A run's directory: `name`, or `name_mbN` for a retry at other sizes (never a failed attempt's files)."""
    return base / (name if (mb, accum) == first else f"{name}_mb{mb}")


def run_dsrecipes(args, cell: Dict[str, Any], with_levers: bool, mb: int, accum: int):
    run_dir = attempt_dir(cell["out"], "dsrecipes_levers" if with_levers else "dsrecipes", mb, accum,
                          (args.micro_batch, args.grad_accum))
    overrides = ds_overrides(args, cell["model_dir"], cell["zero"], cell["data"], run_dir, (mb, accum))
    overrides += levers(args) if with_levers else []
    log = run_dir.with_suffix(".log")
    code, peak, wall = run(args, [sys.executable, "-m", "dsrecipes", *overrides], log)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    tps, spread = steady_tokens_per_s(rows, timed_after(args.steps))
    steps = max((r["step"] for r in rows if "tokens_per_s" in r), default=0)
    return {"exit": code, "tokens_per_s": tps, "tokens_per_s_range": spread, "peak_mem_gib": peak, "wall_s": wall,
            "micro_batch": mb, "grad_accum": accum, "steps": steps,
            "settings": {"overrides": overrides}}, [log, *run_dir.rglob("*.log")]


def steady_tokens_per_s(rows: List[Dict[str, Any]], after_step: int) -> tuple:
    """(tokens/s, [min, max] of its windows' rates): dsrecipes' log windows ending after `after_step`, as TRL's and
    the bare loop's are: all their tokens over all their time. Each metrics line holds its window's rate; its
    window's wall time is the `elapsed` since the previous line, so tokens = rate x that time (a mean of the window
    rates instead would weigh a fast window as much as a slow one: it is >= the true rate whenever they differ)."""
    timed = [r for r in rows if r.get("tokens_per_s") and r.get("elapsed") is not None]
    windows = [(r["tokens_per_s"], r["elapsed"] - prev["elapsed"]) for prev, r in zip(timed, timed[1:])
               if r["step"] > after_step]  # none without two lines: no number (never one window's own rate)
    seconds = sum(s for _, s in windows)
    if seconds <= 0:
        return None, None
    rates = [rate for rate, _ in windows]
    return sum(rate * s for rate, s in windows) / seconds, [min(rates), max(rates)]


def trl_sizes(args, mode: str) -> tuple:
    return (args.trl_micro_batch, args.trl_grad_accum) if mode == "best" else (args.micro_batch, args.grad_accum)


def run_trl(args, cell: Dict[str, Any], mode: str, attn: Optional[str], mb: int, accum: int):
    out = attempt_dir(cell["out"], f"trl_{mode}" + (f"_{attn}" if attn else ""), mb, accum, trl_sizes(args, mode))
    out.mkdir(parents=True, exist_ok=True)
    script = [str(HERE / "_trl_sft.py"), "--model", str(cell["model_dir"]), "--data", cell["data"], "--mode", mode,
              "--seq", str(args.seq), "--micro-batch", str(mb), "--grad-accum", str(accum),
              "--steps", str(args.steps), "--result", str(out / "row.json"), "--deepspeed", str(cell["trl_json"]),
              "--attn", attn or (args.trl_attn if mode == "best" else "auto"), *cell["hf_flags"]]
    if args.cuda:
        argv, env = ["deepspeed", "--num_gpus", "1", "--master_port", str(free_port()), *script], None
    else:  # one rank by hand: the HF Trainer runs DeepSpeed on its CPU accelerator (gloo)
        argv, env = [sys.executable, *script], rank_env()
    code, peak, wall = run(args, argv, out.with_suffix(".log"), env)
    row = json.loads((out / "row.json").read_text()) if (out / "row.json").is_file() else {}
    return {"exit": code, "wall_s": wall, "micro_batch": mb, "grad_accum": accum, **row,
            "peak_mem_gib": peak}, [out.with_suffix(".log")]


def run_bare(args, cell: Dict[str, Any], mb: int, accum: int):
    base = attempt_dir(cell["out"], "bare", mb, accum, (args.micro_batch, args.grad_accum))
    spec = {"model": str(cell["model_dir"]), "ds_json": str(cell["ds_json"]), "micro_batch": mb, "grad_accum": accum,
            "seq": args.seq, "steps": args.steps, "timed_after": timed_after(args.steps), "cuda": args.cuda,
            "result": str(base.with_suffix(".json"))}
    code, peak, wall = run(args, [sys.executable, str(HERE / "_bare_loop.py"), json.dumps(spec)],
                           base.with_suffix(".log"), rank_env())
    path = Path(spec["result"])
    row = json.loads(path.read_text()) if path.is_file() else {}
    return {"exit": code, "wall_s": wall, "micro_batch": mb, "grad_accum": accum, **row,
            "peak_mem_gib": peak}, [base.with_suffix(".log")]


def ds_json(args, model: Path, zero: int, out: Path):
    """The DeepSpeed JSON dsrecipes builds for these settings (the bare loop's), written to out/ds_config.json, and
    dsrecipes' DataLoader workers per rank."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.run.ds_config import build_ds_config

    cfg = compose_and_load(ds_overrides(args, model, zero, "x.jsonl", out / "unused"), check_files=False)
    ds = build_ds_config(cfg, world_size=1)
    (out / "ds_config.json").write_text(json.dumps(ds, indent=1))
    return ds, cfg.data.num_workers


def trl_json(ds: Dict[str, Any], workers: int, out: Path) -> List[str]:
    """dsrecipes' JSON as an HF Trainer user writes it (HF's DeepSpeed guide): the values TrainingArguments own are
    "auto" and come as flags with dsrecipes' values; ZeRO and the optimizer type stay. Returns those flags."""
    hf = dict(ds)
    for key in HF_AUTO:
        hf[key] = "auto"
    params = ds["optimizer"]["params"]
    hf["optimizer"] = {**ds["optimizer"], "params": {**params, **{k: "auto" for k in ("lr", "betas", "eps",
                                                                                      "weight_decay")}}}
    if "bf16" in ds:
        hf["bf16"] = {"enabled": "auto"}
    (out / "trl_ds_config.json").write_text(json.dumps(hf, indent=1))
    values = (params["lr"], params["weight_decay"], params["betas"][0], params["betas"][1], params["eps"],
              ds["gradient_clipping"])
    names = ("--learning-rate", "--weight-decay", "--adam-beta1", "--adam-beta2", "--adam-epsilon", "--max-grad-norm")
    return [w for name, value in zip(names, values) for w in (name, repr(float(value)))] + ["--workers", str(workers)]


def cell_rows(args, name: str, zero: int, data: str, root: Path, flip: bool, note) -> List[Dict[str, Any]]:
    model_dir = write_model(name, root, args.seq)
    out = root / f"{name}_zero{zero}"
    out.mkdir(parents=True, exist_ok=True)
    ds, workers = ds_json(args, model_dir, zero, out)
    cell = {"model_dir": model_dir, "zero": zero, "data": data, "out": out, "ds_json": out / "ds_config.json",
            "trl_json": out / "trl_ds_config.json", "hf_flags": trl_json(ds, workers, out)}
    params = _params(model_dir)
    chosen = [s for s in args.systems.split(",") if s]
    runs = {"dsrecipes": lambda mb, acc: run_dsrecipes(args, cell, False, mb, acc),
            "dsrecipes_levers": lambda mb, acc: run_dsrecipes(args, cell, True, mb, acc),
            "trl_best": lambda mb, acc: run_trl(args, cell, "best", None, mb, acc),
            "trl_plain": lambda mb, acc: run_trl(args, cell, "plain", None, mb, acc),
            "trl_best_flex": lambda mb, acc: run_trl(args, cell, "best", "flex_attention", mb, acc),
            "bare": lambda mb, acc: run_bare(args, cell, mb, acc)}
    rows = []
    for system in (reversed(chosen) if flip else chosen):
        if time.time() > args.deadline:
            note(f"skipped {name} ZeRO-{zero} {system}: time budget {args.budget_s:.0f}s spent")
            continue
        print(f"[gpu_compare] {name} ZeRO-{zero} {system} ...", flush=True)
        sizes = trl_sizes(args, "best" if system.startswith("trl_best") else "plain")
        r = counted(with_oom_retries(runs[system], *sizes, args.deadline, note, f"{name} ZeRO-{zero} {system}"),
                    args.steps)
        tps = r.get("tokens_per_s")
        rows.append({"system": system, "model": name, "params": params, "zero": zero, "seq_len": args.seq,
                     "mfu": flops_per_token(name, params, args.seq) * tps / (args.peak_tflops * 1e12) if tps else None,
                     **r})
        print("[gpu_compare]   " + json.dumps({k: rows[-1].get(k) for k in ("exit", "tokens_per_s", "peak_mem_gib",
                                                                              "not_counted")}),
              flush=True)
    bare = next((r.get("tokens_per_s") for r in rows if r["system"] == "bare"), None)
    tokens_step = args.micro_batch * args.grad_accum * args.seq  # the same at every micro-batch a run fell back to
    for r in rows:
        if bare and r["system"].startswith("dsrecipes") and r.get("tokens_per_s"):
            r["gpu_idle_s_per_step"] = tokens_step / r["tokens_per_s"] - tokens_step / bare
    return rows


def _params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                n = 1
                for d in st.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def write_compare(rows: List[Dict[str, Any]], path: Path) -> None:
    """compare.json: the rows, ROW_KEYS first, written whole (a temporary file renamed onto it)."""
    ordered = [{**{k: r.get(k) for k in ROW_KEYS}, **r} for r in rows]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ordered, indent=1, default=str))
    os.replace(tmp, path)


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    if args.out is None and not args.smoke:
        args.out = default_out(args.cuda)
    with _harness.Result("gpu_compare", args) as result:
        if args.in_process:
            result.note("no CUDA GPU here: CPU dry run in fp32, every system called in this process with the "
                        "arguments a GPU run gives its own process (dsrecipes launcher=local, TRL's DeepSpeed on "
                        "the CPU accelerator); nothing here says anything about a GPU")
        if args.cuda and args.trl_attn == "auto" and importlib.util.find_spec("flash_attn") is None:
            result.note("flash-attn is not installed: TRL best's padding-free batch (one flattened sequence) on sdpa "
                        "is TRL's slow path, so TRL best also runs on flex_attention (trl_best_flex) and the table's "
                        "TRL best is the faster; TRL with flash-attn may be faster still (so may dsrecipes' levers)")
        root = result.out
        data = str(root / "corpus" / "*.jsonl")
        write_corpus(root / "corpus", args.corpus_mb, 4)
        args.deadline, flip = time.time() + args.budget_s, False
        for zero in (int(z) for z in args.zero.split(",")):
            for name in args.models.split(","):
                if time.time() > args.deadline:
                    result.note(f"skipped {name} ZeRO-{zero}: time budget {args.budget_s:.0f}s spent")
                    continue
                for row in cell_rows(args, name, zero, data, root, flip, result.note):
                    result.row(row, echo=False)
                flip = not flip
        failed = [f"{r['model']} ZeRO-{r['zero']} {r['system']} ({r['not_counted']})" for r in result.rows
                  if r.get("not_counted")]
        if failed:
            result.note(f"runs that failed, not counted in the table (see their .log): {failed}")
        write_compare(result.rows, root / "compare.json")
        if result.rows:
            plot(result.rows, root / "compare.png")
        print(ratio_table(result.rows), flush=True)
        for path in [root / "corpus", root / "dsrecipes_cache", *glob.glob(str(root / "model_*"))]:
            shutil.rmtree(path, ignore_errors=True)  # gigabytes of random weights: rebuilt in seconds
        return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
