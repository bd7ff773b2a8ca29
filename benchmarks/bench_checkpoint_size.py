"""Checkpoint size on disk: full fine-tuning vs LoRA, same model, same run (tracker issue 10, item 8).

    python benchmarks/bench_checkpoint_size.py                 # a 30-layer, 576-wide Llama (SmolLM-135M's shape)
    python benchmarks/bench_checkpoint_size.py --tiny          # the embedded tiny model as it is

Each variant is one `python -m dsrecipes` run of one optimizer step (ZeRO-0, fp32, AdamW, local launcher) that
saves a checkpoint; the script prints the bytes of `checkpoints/step_1/` per variant and per file. A LoRA
checkpoint holds the adapter weights, their optimizer state and the data state; the frozen base is rebuilt from
`model.path` (or the embedded model's seed) on resume. No timing: the sizes are exact and repeatable.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

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


def run(root: Path, name: str, overrides: List[str]) -> Dict[str, int]:
    out = root / name
    cmd = [sys.executable, "-m", "dsrecipes", *COMMON, *overrides, f"trainer.output_dir={out}",
           f"data.cache_dir={root / 'cache'}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
    params = next((ln for ln in done.stdout.splitlines() if "parameters" in ln), "")
    print(f"{name}: {params.strip()}")
    return sizes(out / "checkpoints" / "step_1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the embedded tiny model instead of SmolLM-135M's shape")
    args = parser.parse_args()
    shape = [] if args.tiny else SMOL_SHAPE
    with tempfile.TemporaryDirectory(prefix="ckpt_size_") as tmp:
        root = Path(tmp)
        full = run(root, "full", shape)
        lora = run(root, "lora", [*shape, "model.lora.enabled=true"])
    for name, files in (("full", full), ("lora", lora)):
        print(f"\n{name}: {sum(files.values()):,} bytes in {len(files)} files")
        for path, size in files.items():
            if size > 10_000:
                print(f"  {size:>14,}  {path}")
    print(f"\nLoRA / full: {sum(lora.values()) / sum(full.values()):.4f}")


if __name__ == "__main__":
    main()
