"""`dsrecipes prompt-eval --baseline A --finetuned B [--prompts P]`: two models answer the same prompts, side by side."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import List

from dsrecipes.commands.args import parse
from dsrecipes.fileio import atomic_write_json


def main(argv: List[str]) -> int:
    from dsrecipes import prompt_eval as pe
    from dsrecipes.export import EXPORT_DIR, EXPORT_INIT_DIR

    parser = argparse.ArgumentParser(prog="dsrecipes prompt-eval", description=pe.__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="HF model dir, or a run dir (uses RUN/export_init)")
    parser.add_argument("--finetuned", required=True, help="HF model dir, or a run dir (uses RUN/export)")
    parser.add_argument("--prompts", default=str(pe.DEFAULT_PROMPTS), help="JSONL with prompt (+ reference, system)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--json", default=None, help="also write the answers and scores to this JSON file")
    args = parse(parser, argv)
    prompts = pe.read_prompts(Path(args.prompts))
    finetuned_dir = pe.model_dir(args.finetuned, EXPORT_DIR)
    baseline_dir = pe.model_dir(args.baseline, EXPORT_INIT_DIR)
    tokenizer = pe.load_tokenizer(finetuned_dir)
    scores = {}
    for name, path in (("baseline", baseline_dir), ("finetuned", finetuned_dir)):
        model_tokenizer = pe.load_tokenizer(path, chat_template=tokenizer.chat_template)
        scores[name] = pe.evaluate_model(pe.load_model(path), model_tokenizer, prompts, args.max_new_tokens)
    pe.print_side_by_side(prompts, scores)
    if args.json:
        atomic_write_json(args.json, {k: asdict(v) for k, v in scores.items()}, indent=1)
    return 0
