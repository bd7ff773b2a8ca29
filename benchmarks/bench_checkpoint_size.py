"""Checkpoint size on disk: full fine-tuning vs LoRA, same model, same run (tracker issue 10, item 8).

    python benchmarks/bench_checkpoint_size.py                 # a 30-layer, 576-wide Llama (SmolLM-135M's shape)
    python benchmarks/bench_checkpoint_size.py --tiny          # the embedded tiny model as it is
    python benchmarks/bench_checkpoint_size.py --smoke         # --tiny, 8 samples, both runs in this process: seconds

Each variant is one `python -m dsrecipes` run of one optimizer step (ZeRO-0, fp32, AdamW, local launcher) that
saves a checkpoint; the script prints the bytes of `checkpoints/step_1/` per variant and per file. A LoRA
checkpoint holds the adapter weights, their optimizer state and the data state; the frozen base is rebuilt from
`model.path` (or the embedded model's seed) on resume. No timing: the sizes are exact and repeatable. Result file:
<out>/bench_checkpoint_size.json (--out DIR).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from _harness import Result, add_args
from _run_system import run_here

# SmolLM-135M's layer shapes (hidden 576, MLP 1536, 30 layers, 9 heads / 3 KV heads, tied embeddings); the
# vocabulary is the bundled tokenizer's, so the parameter count is below 135M.
SMOL_SHAPE = [
    "model.tiny.hidden_size=576", "model.tiny.intermediate_size=1536", "model.tiny.num_hidden_layers=30",
    "model.tiny.num_attention_heads=9", "model.tiny.num_key_value_heads=3",
]  # fmt: skip
COMMON = [
    "trainer.max_steps=1", "trainer.save_every=1", "trainer.micro_batch_size=1", "trainer.export=false",
    "trainer.eval_every=0", "data.cutoff_len=64", "dataset.max_samples=40", "dataset.val_size=0", "trainer.report_to=[]",
    "scheduler.warmup_steps=0",
]  # fmt: skip


def sizes(tag: Path) -> Dict[str, int]:
    return {str(f.relative_to(tag)): f.stat().st_size for f in sorted(tag.rglob("*")) if f.is_file()}


def run(root: Path, name: str, overrides: List[str], result: Result) -> Dict[str, int]:
    out = root / name
    cmd = [sys.executable, "-m", "dsrecipes", *COMMON, *overrides, f"trainer.output_dir={out}",
           f"data.cache_dir={root / 'cache'}"]
    if result.smoke:  # the same command, its entry point called here: one torch import for both variants
        log = root / f"{name}.log"
        code = run_here(cmd, log, env=None)
        stdout = stderr = log.read_text(errors="replace")  # one log holds both
    else:
        done = subprocess.run(cmd, capture_output=True, text=True)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    if code != 0:
        sys.exit(f"{name}: exit {code}\n{stderr[-3000:]}")
    params = next((ln for ln in stdout.splitlines() if "parameters" in ln), "")
    print(f"{name}: {params.strip()}")
    files = sizes(out / "checkpoints" / "step_1")
    if not files:
        sys.exit(f"{name}: no checkpoint files in {out / 'checkpoints' / 'step_1'}")
    result.row({"variant": name, "parameters_line": params.strip(), "bytes": sum(files.values()), "files": files},
               echo=False)
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny model instead of SmolLM-135M's shape")
    args = add_args(parser).parse_args()
    with Result("bench_checkpoint_size", args) as result:
        measure(args, result)


def measure(args: argparse.Namespace, result: Result) -> None:
    shape = [] if args.tiny or args.smoke else SMOL_SHAPE
    if args.smoke:
        shape = ["dataset.max_samples=8", "data.cutoff_len=32"]
        result.note("smoke: each variant's `python -m dsrecipes ...` is called as dsrecipes.cli.main(...) in this "
                    "process (as gpu_compare's CPU dry run does), not in a process of its own")
    with tempfile.TemporaryDirectory(prefix="ckpt_size_") as tmp:
        root = Path(tmp)
        full = run(root, "full", shape, result)
        lora = run(root, "lora", [*shape, "model.lora.enabled=true"], result)
    for name, files in (("full", full), ("lora", lora)):
        print(f"\n{name}: {sum(files.values()):,} bytes in {len(files)} files")
        for path, size in files.items():
            if size > 10_000:
                print(f"  {size:>14,}  {path}")
    print(f"\nLoRA / full: {sum(lora.values()) / sum(full.values()):.4f}")
    result.extra["lora_over_full"] = sum(lora.values()) / sum(full.values())


if __name__ == "__main__":
    main()
