"""TRL's side of benchmarks/gpu_compare.py (not a benchmark itself): TRL's SFTTrainer as its documentation starts it.

Owner: benchmarks/. Started by gpu_compare.py as `deepspeed --num_gpus 1 _trl_sft.py ... --deepspeed DS.json` (the
HF Trainer's documented DeepSpeed path) or, in the CPU dry run (--smoke), by calling `main(argv)` with the same
arguments inside gpu_compare's process (the HF Trainer then runs DeepSpeed on its CPU accelerator, gloo). DS.json
is dsrecipes' ZeRO JSON with the values the HF Trainer owns set to "auto", as HF's DeepSpeed guide writes it; the
optimizer hyper-parameters come as HF flags with dsrecipes' values (same optimizer, same ZeRO settings).
The ShareGPT files are read with `datasets` and turned into `messages` (a row's `system` first; human -> user, gpt
and function_call -> assistant, observation -> user, system -> system); SFTTrainer tokenizes them with the model's
chat template. `--mode best`: packing (bfd), padding_free, use_liger_kernel when liger-kernel is installed (CUDA),
flash_attention_2 when flash-attn is installed (else sdpa, or --attn), no gradient checkpointing (as dsrecipes' default), bf16
on CUDA, DataLoader workers as dsrecipes'; `--mode plain`: TRL's defaults (no packing, padded batches, TRL's
default gradient checkpointing). Writes one JSON row (tokens/s over the steps after the first third: from the end of step timed_after(steps),
as the other systems; real tokens: `token_count` says how) to --result.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import List, Optional

from _compare_rows import log_every, timed_after

ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "user", "system": "system"}
HF_FLOATS = ("--learning-rate", "--weight-decay", "--adam-beta1", "--adam-beta2", "--adam-epsilon", "--max-grad-norm")


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    for name in ("--model", "--data", "--result", "--mode"):
        p.add_argument(name, required=True)
    for name in ("--seq", "--micro-batch", "--grad-accum", "--steps", "--workers"):
        p.add_argument(name, type=int, required=True)
    for name in HF_FLOATS:
        p.add_argument(name, type=float, required=True)
    p.add_argument("--deepspeed", default=None)
    p.add_argument("--attn", default="auto", help="auto: flash_attention_2 for --mode best where flash-attn is "
                   "installed on CUDA, else sdpa")
    p.add_argument("--local_rank", type=int, default=0)  # set by the deepspeed launcher
    return p.parse_args(argv)


def messages(files: list) -> list:
    out = []
    for path in files:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            turns = [{"role": "system", "content": row["system"]}] if row.get("system") else []
            turns += [{"role": ROLES[t["from"]], "content": t["value"]} for t in row["conversations"]]
            out.append({"messages": turns})
    return out


class Clock:
    """A TrainerCallback (built in `main`) that notes the time and the tokens seen at every optimizer step."""

    def __init__(self) -> None:
        self.marks = []

    def on_step_end(self, args, state, control, **kwargs):
        self.marks.append((time.perf_counter(), state.num_input_tokens_seen))


def sft_settings(args: argparse.Namespace, cuda: bool) -> dict:
    """SFTConfig's arguments for --mode best or plain."""
    # logging_steps: a log line as often as dsrecipes' (gpu_compare's trainer.log_every), each a device sync
    settings = dict(max_length=args.seq, per_device_train_batch_size=args.micro_batch, max_steps=args.steps,
                    gradient_accumulation_steps=args.grad_accum, save_strategy="no", report_to=[],
                    logging_steps=log_every(args.steps), output_dir=str(Path(args.result).parent / "trl_out"),
                    include_num_input_tokens_seen=token_count(args), bf16=cuda, use_cpu=not cuda, deepspeed=args.deepspeed,
                    learning_rate=args.learning_rate, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
                    adam_beta2=args.adam_beta2, adam_epsilon=args.adam_epsilon, max_grad_norm=args.max_grad_norm,
                    dataset_num_proc=8 if cuda else None)  # tokenizing before training: not timed, only faster
    if args.mode == "best":
        liger = cuda and importlib.util.find_spec("liger_kernel") is not None
        settings.update(packing=True, padding_free=True, use_liger_kernel=liger, gradient_checkpointing=False,
                        dataloader_num_workers=args.workers)
    return settings


def token_count(args: argparse.Namespace) -> str:
    """How the HF Trainer counts `num_input_tokens_seen`: real tokens, as dsrecipes and the bare loop count theirs.
    A padded batch (plain) has an attention mask, which "non_padding" sums. A padding-free batch (best: one flattened
    sequence, no pad in it, TRL's pad_to_multiple_of None on a GPU) has none, and "non_padding" would count the
    tokens that differ from the pad id instead: where pad = eos (TRL sets it so when a tokenizer has no pad token)
    and the chat template writes eos at every turn's end (Llama 3's <|eot_id|>), TRL's tokens would be undercounted
    by one a turn. So "all" (every token of the flattened sequence) there."""
    return "all" if args.mode == "best" else "non_padding"


def attention(args: argparse.Namespace, cuda: bool) -> str:
    if args.attn != "auto":
        return args.attn
    best = args.mode == "best" and cuda and importlib.util.find_spec("flash_attn") is not None
    return "flash_attention_2" if best else "sdpa"


def timed_rate(marks: List[tuple], steps: int) -> dict:
    """tokens/s of the optimizer steps after step `timed_after(steps)` (marks[k]: (time, tokens seen) at the end of
    step k + 1), as gpu_compare times dsrecipes (its log windows after that step) and the bare loop (the same steps)."""
    start = min(max(timed_after(steps) - 1, 0), len(marks) - 1)
    (t0, n0), (t1, n1) = marks[start], marks[-1]
    timed = max(len(marks) - 1 - start, 1)
    rates = [(n - m) / (t - s) for (s, m), (t, n) in zip(marks[start:], marks[start + 1:]) if t > s]
    return {"tokens_per_s": (n1 - n0) / (t1 - t0) if t1 > t0 else None, "steps": len(marks),
            "tokens_per_s_range": [min(rates), max(rates)] if rates else None,  # of its timed steps
            "tokens_per_step": (n1 - n0) / timed, "step_s": (t1 - t0) / timed, "timed_steps": len(marks) - 1 - start}


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    if not cuda:  # DeepSpeed's CPU accelerator would JIT-build its shared-memory op (minutes) that training never uses
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from dsrecipes.core.distributed import skip_shm_comm_op

        skip_shm_comm_op()
    settings = sft_settings(args, cuda)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation=attention(args, cuda))
    clock = type("ClockCallback", (Clock, TrainerCallback), {})()
    data = Dataset.from_list(messages(sorted(glob.glob(args.data))))
    trainer = SFTTrainer(model=model, args=SFTConfig(**settings), train_dataset=data, processing_class=tokenizer,
                         callbacks=[clock])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    row = {**timed_rate(clock.marks, args.steps),
           "torch_peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "settings": {**{k: v for k, v in settings.items() if k != "output_dir"},
                        "attn_implementation": attention(args, cuda), "deepspeed_json": args.deepspeed}}
    if args.local_rank in (0, -1):
        Path(args.result).write_text(json.dumps(row, indent=1, default=str))


if __name__ == "__main__":
    main()
