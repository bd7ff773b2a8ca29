"""TRL's side of benchmarks/gpu_compare.py (not a benchmark itself): TRL's SFTTrainer as its documentation starts it.

Owner: benchmarks/. Started by gpu_compare.py as `deepspeed --num_gpus 1 _trl_sft.py ... --deepspeed DS.json` (the
HF Trainer's documented DeepSpeed path; the same ZeRO JSON dsrecipes builds) or, on CPU (--smoke), with plain
`python`. The ShareGPT files are read with `datasets` and turned into `messages` (human -> user, gpt and
function_call -> assistant, observation -> user, system -> system); SFTTrainer then tokenizes them with the model's
chat template. `--mode best`: packing (bfd), padding_free, use_liger_kernel when liger-kernel is installed, bf16 on
CUDA; `--mode plain`: TRL's defaults (no packing, padded batches). Writes one JSON row (tokens/s over the steps after
the first third, peak GPU memory) to --result.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import time
from pathlib import Path

ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "user", "system": "system"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name in ("--model", "--data", "--result", "--mode"):
        p.add_argument(name, required=True)
    for name in ("--seq", "--micro-batch", "--grad-accum", "--steps"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--deepspeed", default=None)
    p.add_argument("--local_rank", type=int, default=0)  # set by the deepspeed launcher
    return p.parse_args()


def messages(files: list) -> list:
    out = []
    for path in files:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            turns = json.loads(line)["conversations"]
            out.append({"messages": [{"role": ROLES[t["from"]], "content": t["value"]} for t in turns]})
    return out


class Clock:
    """A TrainerCallback (built in `main`) that notes the time and the tokens seen at every optimizer step."""

    def __init__(self) -> None:
        self.marks = []

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append((time.perf_counter(), state.num_input_tokens_seen))


def main() -> None:
    args = parse_args()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    best = args.mode == "best"
    liger = best and cuda and importlib.util.find_spec("liger_kernel") is not None
    settings = dict(max_length=args.seq, per_device_train_batch_size=args.micro_batch, max_steps=args.steps,
                    gradient_accumulation_steps=args.grad_accum, save_strategy="no", report_to=[],
                    logging_steps=max(args.steps // 5, 1), output_dir=str(Path(args.result).parent / "trl_out"),
                    include_num_input_tokens_seen="non_padding", bf16=cuda, use_cpu=not cuda, deepspeed=args.deepspeed)
    if best:
        settings.update(packing=True, padding_free=True, use_liger_kernel=liger)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="sdpa")
    clock = type("ClockCallback", (Clock, TrainerCallback), {})()
    data = Dataset.from_list(messages(sorted(glob.glob(args.data))))
    trainer = SFTTrainer(model=model, args=SFTConfig(**settings), train_dataset=data, processing_class=tokenizer,
                         callbacks=[clock])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    start = len(clock.marks) // 3
    (t0, n0), (t1, n1) = clock.marks[start], clock.marks[-1]
    row = {"tokens_per_s": (n1 - n0) / (t1 - t0) if t1 > t0 else None, "steps": len(clock.marks),
           "tokens_per_step": (n1 - n0) / max(len(clock.marks) - 1 - start, 1),
           "step_s": (t1 - t0) / max(len(clock.marks) - 1 - start, 1),
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "settings": {k: v for k, v in settings.items() if k not in ("output_dir",)}, "liger": liger}
    if args.local_rank in (0, -1):
        Path(args.result).write_text(json.dumps(row, indent=1, default=str))


if __name__ == "__main__":
    main()
