"""Side by side on one GPU: dsrecipes' default recipe against TRL's SFTTrainer (best documented settings and plain
defaults) and a bare DeepSpeed loop, same model, data, sequence length and tokens per optimizer step (issue 46).

    python benchmarks/gpu_compare.py                       # one H200/H100, no network: about 8 minutes
    python benchmarks/gpu_compare.py --smoke --out DIR     # CPU dry run of the same code path: tiny model, 3 steps

Rows: a Qwen2.5-0.5B- and a Qwen2.5-1.5B-shaped random model (config only, written once as a local model directory
with the bundled tokenizer) x ZeRO-2 and ZeRO-3. Each cell runs these systems, each as a user starts it, in its own
process, the order alternating from cell to cell (A/B, B/A):
  dsrecipes         `python -m dsrecipes` (launcher=deepspeed): the default recipe, only model/data/sizes/ZeRO set;
  dsrecipes_levers  the same plus the issue-46 levers (data.packing=true, trainer.ce_chunk_tokens=4096): measured
                    here so that a lever becomes a default only where it wins;
  trl_best          `deepspeed _trl_sft.py --deepspeed DS.json` (HF Trainer + the same ZeRO JSON): packing,
                    padding_free, use_liger_kernel when installed, bf16;
  trl_plain         the same launch with TRL's defaults (no packing, padded batches);
  bare              a bare `deepspeed.initialize` loop on random batches of the same shape (micro_batch x seq),
                    the floor the runner is compared with: gpu_idle_s_per_step = its step time minus the bare one.
Tokens per optimizer step = micro_batch x grad_accum x seq everywhere (TRL's plain defaults pad, so it trains fewer
real tokens per step: its tokens/s counts real tokens). Peak memory: the largest `nvidia-smi` memory.used seen while
the process ran (the same for every system). MFU = (6 N + 12 L d T) x tokens/s / peak (N all parameters, L layers,
d hidden size, T seq: attention FLOPs counted as PaLM does, full T x T).
Writes OUT/compare.json (rows {system, model, params, zero, micro_batch, seq_len, tokens_per_s, mfu, peak_mem_gib,
settings, ...}) and compare.png, and prints the ratio table. --out defaults to benchmarks/results/<date>_<device>.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import _harness
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
                 num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True),
}
SYSTEMS = ("dsrecipes", "dsrecipes_levers", "trl_best", "trl_plain", "bare")
LEVERS = ["data.packing=true", "trainer.ce_chunk_tokens=4096"]


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = _harness.add_args(argparse.ArgumentParser(description=__doc__,
                                                  formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    p.add_argument("--zero", default="2,3")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8, help="dsrecipes' and the bare loop's micro-batch")
    p.add_argument("--trl-micro-batch", type=int, default=8, help="TRL best: the largest that fits (found before)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--budget-s", type=float, default=450.0, help="cells that would start later are skipped")
    p.add_argument("--run-timeout-s", type=float, default=150.0)
    p.add_argument("--corpus-mb", type=float, default=8.0)
    args = p.parse_args(argv)
    args.cuda = _cuda()
    if args.smoke:
        args.models, args.zero, args.seq, args.micro_batch, args.trl_micro_batch = "tiny", "2", 64, 2, 2
        args.steps, args.corpus_mb, args.budget_s = 2, 0.05, 300.0
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


class MemPoll:
    """The largest nvidia-smi memory.used (GiB) while a child runs (None without a GPU)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.peak, self.stop = cuda, None, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stop.wait(0.5):
            got = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout.split()
            if got:
                self.peak = max(self.peak or 0.0, float(got[0]) / 1024)

    def __enter__(self) -> "MemPoll":
        if self.cuda:
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()


def run_child(argv: List[str], log: Path, timeout: float, cuda: bool, env: Optional[Dict[str, str]] = None):
    """(exit code or 'timeout', peak GiB, wall seconds) of one system's process."""
    t0 = time.time()
    with MemPoll(cuda) as mem, open(log, "w") as fh:
        try:
            code = subprocess.run(argv, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    return code, mem.peak, time.time() - t0


def ds_overrides(args: argparse.Namespace, model: Path, zero: int, data: str, run_dir: Path) -> List[str]:
    hw = ["precision=bf16", "launcher=deepspeed", "launcher.num_gpus=1"] if args.cuda else \
        ["precision=fp32", "trainer.device=cpu", "launcher=deepspeed", "launcher.num_gpus=1"]
    return [f"model.path={model}", "dataset=sharegpt_files", f"dataset.paths=[{data}]", f"zero=stage{zero}",
            f"data.cutoff_len={args.seq}", f"trainer.micro_batch_size={args.micro_batch}",
            f"trainer.grad_accum={args.grad_accum}", f"trainer.max_steps={args.steps}",
            f"trainer.log_every={max(args.steps // 6, 1)}", "trainer.eval_every=0", "trainer.eval_at_start=false",
            "trainer.export=false", "trainer.report_to=[]", f"trainer.output_dir={run_dir}", *hw]


def run_dsrecipes(args, cell: Dict[str, Any], levers: bool) -> Dict[str, Any]:
    run_dir = cell["out"] / ("dsrecipes_levers" if levers else "dsrecipes")
    overrides = ds_overrides(args, cell["model_dir"], cell["zero"], cell["data"], run_dir) + (LEVERS if levers else [])
    code, peak, wall = run_child([sys.executable, "-m", "dsrecipes", *overrides], run_dir.with_suffix(".log"),
                                 args.run_timeout_s, args.cuda)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    steady = [r for r in rows if r.get("tokens_per_s")][1:] or [r for r in rows if r.get("tokens_per_s")]
    tps = sum(r["tokens_per_s"] for r in steady) / len(steady) if steady else None
    return {"exit": code, "tokens_per_s": tps, "peak_mem_gib": peak, "wall_s": wall,
            "micro_batch": args.micro_batch, "settings": {"overrides": overrides}}


def run_trl(args, cell: Dict[str, Any], mode: str) -> Dict[str, Any]:
    out = cell["out"] / f"trl_{mode}"
    out.mkdir(parents=True, exist_ok=True)
    mb = args.trl_micro_batch if mode == "best" else args.micro_batch
    script = [str(HERE / "_trl_sft.py"), "--model", str(cell["model_dir"]), "--data", cell["data"], "--mode", mode,
              "--seq", str(args.seq), "--micro-batch", str(mb), "--grad-accum", str(args.grad_accum),
              "--steps", str(args.steps), "--result", str(out / "row.json")]
    if args.cuda:
        argv = ["deepspeed", "--num_gpus", "1", "--master_port", str(free_port()), *script,
                "--deepspeed", str(cell["ds_json"])]
    else:  # CPU dry run: the HF Trainer without DeepSpeed (it needs an accelerator for ZeRO)
        argv = [sys.executable, *script]
    code, peak, wall = run_child(argv, out.with_suffix(".log"), args.run_timeout_s, args.cuda)
    row = json.loads((out / "row.json").read_text()) if (out / "row.json").is_file() else {}
    return {"exit": code, "peak_mem_gib": peak, "wall_s": wall, "micro_batch": mb, **row}


def run_bare(args, cell: Dict[str, Any]) -> Dict[str, Any]:
    spec = {"model": str(cell["model_dir"]), "ds_json": str(cell["ds_json"]), "micro_batch": args.micro_batch,
            "seq": args.seq, "steps": args.steps, "cuda": args.cuda, "result": str(cell["out"] / "bare.json")}
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    code, peak, wall = run_child([sys.executable, str(HERE / "_bare_loop.py"), json.dumps(spec)],
                                 cell["out"] / "bare.log", args.run_timeout_s, args.cuda, env)
    path = Path(spec["result"])
    row = json.loads(path.read_text()) if path.is_file() else {}
    return {"exit": code, "peak_mem_gib": peak, "wall_s": wall, "micro_batch": args.micro_batch, **row}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_json(args, model: Path, zero: int, out: Path) -> Path:
    """The DeepSpeed JSON dsrecipes builds for these settings, for TRL and the bare loop (HF's 'auto' not needed)."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.run.ds_config import build_ds_config

    cfg = compose_and_load(ds_overrides(args, model, zero, "x.jsonl", out / "unused"), check_files=False)
    path = out / "ds_config.json"
    path.write_text(json.dumps(build_ds_config(cfg, world_size=1), indent=1))
    return path


def cell_rows(args, name: str, zero: int, data: str, root: Path, flip: bool) -> List[Dict[str, Any]]:
    model_dir = write_model(name, root, args.seq)
    out = root / f"{name}_zero{zero}"
    out.mkdir(parents=True, exist_ok=True)
    cell = {"model_dir": model_dir, "zero": zero, "data": data, "out": out, "ds_json": ds_json(args, model_dir, zero, out)}
    params = _params(model_dir)
    chosen = [s for s in args.systems.split(",") if s]
    runs = {"dsrecipes": lambda: run_dsrecipes(args, cell, False), "dsrecipes_levers": lambda: run_dsrecipes(args, cell, True),
            "trl_best": lambda: run_trl(args, cell, "best"), "trl_plain": lambda: run_trl(args, cell, "plain"),
            "bare": lambda: run_bare(args, cell)}
    rows = []
    for system in (reversed(chosen) if flip else chosen):
        print(f"[gpu_compare] {name} ZeRO-{zero} {system} ...", flush=True)
        r = runs[system]()
        tps = r.get("tokens_per_s")
        rows.append({"system": system, "model": name, "params": params, "zero": zero, "seq_len": args.seq,
                     "mfu": flops_per_token(name, params, args.seq) * tps / (args.peak_tflops * 1e12) if tps else None,
                     **r})
        print("[gpu_compare]   " + json.dumps({k: rows[-1].get(k) for k in ("exit", "tokens_per_s", "peak_mem_gib")}),
              flush=True)
    step = {r["system"]: r for r in rows}
    if "bare" in step and step["bare"].get("step_s"):
        tokens_step = args.micro_batch * args.grad_accum * args.seq
        for r in rows:
            if r["system"].startswith("dsrecipes") and r.get("tokens_per_s"):
                r["gpu_idle_s_per_step"] = tokens_step / r["tokens_per_s"] - step["bare"]["step_s"]
    return rows


def _params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(_prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def _prod(shape: List[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def ratio_table(rows: List[Dict[str, Any]]) -> str:
    lines = ["model          ZeRO  dsrecipes tok/s  MFU    levers tok/s  trl_best  trl_plain  bare   ds/trl_best ds/trl_plain"]
    cells = sorted({(r["model"], r["zero"]) for r in rows})
    for model, zero in cells:
        by = {r["system"]: r.get("tokens_per_s") for r in rows if (r["model"], r["zero"]) == (model, zero)}
        mfu = next((r.get("mfu") for r in rows if (r["model"], r["zero"], r["system"]) == (model, zero, "dsrecipes")), None)
        best_ds = max([v for k, v in by.items() if k.startswith("dsrecipes") and v] or [0])

        def f(v, fmt=".0f"):
            return format(v, fmt) if v else "-"
        lines.append(f"{model:<14} {zero:<5} {f(by.get('dsrecipes')):>15}  {f(mfu, '.1%'):>5}  "
                     f"{f(by.get('dsrecipes_levers')):>12}  {f(by.get('trl_best')):>8}  {f(by.get('trl_plain')):>9}  "
                     f"{f(by.get('bare')):>5}  {f(best_ds / by['trl_best'] if by.get('trl_best') else None, '.2f'):>11} "
                     f"{f(best_ds / by['trl_plain'] if by.get('trl_plain') else None, '.2f'):>12}")
    return "\n".join(lines)


def plot(rows: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r["model"], r["zero"]) for r in rows})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    fig, ax = plt.subplots(figsize=(2 + 2 * len(cells), 4))
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        values = [next((r.get("tokens_per_s") or 0 for r in rows if (r["model"], r["zero"], r["system"]) ==
                        (m, z, system)), 0) for m, z in cells]
        ax.bar([c + i * width for c in range(len(cells))], values, width, label=system)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cells))], [f"{m}\nZeRO-{z}" for m, z in cells])
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    if args.out is None and not args.smoke:
        args.out = default_out(args.cuda)
    with _harness.Result("compare", args) as result:
        if not args.cuda:
            result.note("no CUDA GPU here: CPU dry run in fp32, launcher=deepspeed for dsrecipes, TRL without "
                        "DeepSpeed (plain python); nothing here says anything about a GPU")
        root = result.out
        data = str(root / "corpus" / "*.jsonl")
        write_corpus(root / "corpus", args.corpus_mb, 4)
        started, flip = time.time(), False
        for name in args.models.split(","):
            for zero in (int(z) for z in args.zero.split(",")):
                if time.time() - started > args.budget_s:
                    result.note(f"skipped {name} ZeRO-{zero}: time budget {args.budget_s:.0f}s spent")
                    continue
                for row in cell_rows(args, name, zero, data, root, flip):
                    result.row(row, echo=False)
                flip = not flip
        failed = [f"{r['model']} ZeRO-{r['zero']} {r['system']}" for r in result.rows if r.get("exit") != 0]
        if failed:
            result.note(f"runs that failed (see their .log): {failed}")
        (root / "compare_rows.json").write_text(json.dumps(result.rows, indent=1, default=str))
        if result.rows:
            plot(result.rows, root / "compare.png")
        print(ratio_table(result.rows), flush=True)
        shutil.rmtree(root / "corpus", ignore_errors=True)
        for model_dir in glob.glob(str(root / "model_*")):
            shutil.rmtree(model_dir, ignore_errors=True)  # gigabytes of random weights: rebuilt in seconds
        return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
