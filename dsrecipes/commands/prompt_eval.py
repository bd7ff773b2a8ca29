"""`dsrecipes prompt-eval --finetuned M [--baseline B] [--prompts P]`: models answer the same prompts, side by side
(prompt_eval.py has the format of P and the scores; without P, the run's validation conversations are asked)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

from dsrecipes.boundary.trust import FLAG, TRUST_HELP, trust
from dsrecipes.commands.args import MAX_NEW_TOKENS, bounded_int, command_parser, existing_path, parse, positive_int
from dsrecipes.core.export_dir import EXPORT_DIR
from dsrecipes.serve import prompt_eval as pe


def main(argv: List[str]) -> int:
    from dsrecipes.serve.inference import resolve_model_path  # lazy: else `commands.prompt_eval` imports torch 3.80 s

    parser = command_parser("prompt-eval", pe.__doc__.split("\n")[0],
                            epilog="--prompts format: one JSON object per line with 'prompt' and optional "
                                   "'reference' and 'system' (example: dsrecipes/assets/sample_data/prompts.jsonl); "
                                   "default: the run's validation conversations")
    parser.add_argument("--finetuned", required=True, help="run dir, export, merged or adapter-only LoRA export")
    parser.add_argument("--baseline", default=None, help="run dir (its starting model) or any model dir")
    parser.add_argument("--prompts", default=None, help="JSONL: prompt, optional reference and system")
    parser.add_argument("--limit", type=positive_int, default=32, help="at most this many prompts (default 32)")
    parser.add_argument("--max-new-tokens", type=bounded_int(MAX_NEW_TOKENS, "tokens generated per answer"), default=48,
                        help="answer length cap (default 48)")
    parser.add_argument("--json", default=None, help="also write the answers and scores to this JSON file (a new "
                                                     "file, or one an earlier prompt-eval wrote)")
    parser.add_argument(FLAG, action="append", default=[], type=existing_path, metavar="PATH", help=TRUST_HELP)
    args = parse(parser, argv)
    if args.json:
        pe.check_json_out(args.json)  # before any model is loaded: a bad path never costs a whole evaluation
    trust(args.trust_checkpoint)
    retry = f"dsrecipes prompt-eval --finetuned {args.finetuned}" + (f" --baseline {args.baseline}" if args.baseline
                                                                    else "")
    finetuned = resolve_model_path(args.finetuned, retry=retry)
    baseline = resolve_model_path(args.baseline, baseline=True, retry=retry) if args.baseline else None
    note = started_from_note(args.baseline, baseline, finetuned)
    if note:
        print(note, flush=True)
    rows = pe.prompt_rows(finetuned, args.prompts, args.limit)
    scores = pe.compare(finetuned, baseline, rows, args.max_new_tokens)
    pe.print_side_by_side(rows, scores)
    if args.json:
        pe.write_scores(args.json, scores)
    return 0


def started_from_note(arg: Optional[str], baseline: Any, finetuned: Any) -> Optional[str]:
    """`--baseline RUN` is the model RUN started from, not what it trained: said when RUN is another run than the
    fine-tuned one and has an export (`--baseline runs/sft --finetuned runs/dpo` compared DPO with SFT's start)."""
    if baseline is None or baseline.run_dir is None or baseline.run_dir == finetuned.run_dir:
        return None
    run = baseline.run_dir
    if Path(arg).expanduser().resolve() != run or not (run / EXPORT_DIR / "config.json").is_file():
        return None
    return (f"baseline: {arg} is a run directory, so the model it started from answers ({baseline.path}); to "
            f"compare with the model it trained, give --baseline {Path(arg) / EXPORT_DIR}")
