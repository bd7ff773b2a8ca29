"""Training-side cost of rendering a model's own chat template in the sandbox (dsrecipes/boundary/chat_sandbox.py).

    python benchmarks/bench_chat_sandbox.py                  # 3000 conversations, 3 rounds, SmolLM2's template
    python benchmarks/bench_chat_sandbox.py --n 500 --rounds 1

Conversations: `--n` of them, 1-3 user/assistant exchanges each, taken from the rows of tests/fixtures/data/
small.jsonl.gz and array.json (seeded), a system prompt on every fourth. Tokenizer and template: SmolLM2-135M-Instruct's (scripts/fetch_smollm2.py; without it,
the bundled tiny tokenizer with a ChatML chat_template, noted). Each round times, in this process:
* encode: `Encoder(template=tokenizer).encode_arrays` over all conversations in batches of 256 (what a
  data-preparation worker does: every assistant turn renders two prefixes, so ~2 renders per exchange + 1), its
  wall-clock rate and its CPU time per conversation, this process's and its renderer child's (a shared machine
  disturbs the CPU time much less than the wall clock);
* pairs: `PairEncoder.encode_batch` over the bundled preference pairs (`--n`/3 of them) in batches of 256 (DPO's
  preparation: each answer renders its conversation and the prompt's generation prefix);
* render: `chat_sandbox.render` of each whole conversation once, one call each (chat, prompt-eval).
Each round runs twice, in alternating order: through the sandbox (the child process), and in process - the same
`ImmutableSandboxedEnvironment` and render function (chat_render_child.py) called in this process, with no child,
no limits and no pickling: the baseline the sandbox's cost is measured against.
Prints conversations/s and renders/s per round and mode, their medians and the sandbox/in-process ratios.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, List

from _harness import REPO, Result, add_args

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def conversations(n: int) -> List[Any]:
    """`n` Conversations of 1-3 exchanges, each exchange a user/assistant pair of the fixtures' rows (seeded)."""
    from dsrecipes.data.sources.sharegpt import Conversation, Role, Turn

    data = REPO / "tests" / "fixtures" / "data"
    rows = [json.loads(line) for line in gzip.open(data / "small.jsonl.gz", "rt") if line.strip()]
    rows += [r for r in json.loads((data / "array.json").read_text()) if isinstance(r, dict)]
    pairs = []
    for row in rows:
        turns = [t for t in row["conversations"] if t["from"] in ("human", "gpt")]
        pairs += [(a["value"], b["value"]) for a, b in zip(turns, turns[1:]) if (a["from"], b["from"]) == ("human", "gpt")]
    rng = random.Random(0)
    out = []
    for i in range(n):
        turns = []
        for q, a in (rng.choice(pairs) for _ in range(rng.randint(1, 3))):
            turns += [Turn(Role.user, q), Turn(Role.assistant, a)]
        out.append(Conversation(f"c{i}", turns, system="Be brief." if i % 4 == 0 else None))
    return out


def renderer_cpu() -> float:
    """CPU seconds of this process's template-renderer child so far (0 without one: an in-process sandbox)."""
    renderer = getattr(sys.modules.get("dsrecipes.boundary.chat_sandbox"), "_RENDERER", None)
    child = getattr(renderer, "child", None)
    if child is None:
        return 0.0
    fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class InProcess:
    """The baseline renderer: chat_render_child.py's environment and render, called in this process (no child)."""

    child = None  # (renderer_cpu: no child's CPU time to add)

    def __init__(self) -> None:
        from dsrecipes.boundary import chat_render_child as child_code
        from dsrecipes.boundary.chat_sandbox import MAX_OUTPUT

        self.code, self.env, self.compiled, self.max_output = child_code, child_code._environment(), {}, MAX_OUTPUT

    def render(self, source: str, context: dict, jobs: list) -> list:
        """chat_sandbox._Renderer.render's answers: per (tools, renders) job, its (kind, text) answers."""
        out = []
        for tools, renders in jobs:
            answers = []
            for messages, generation in renders:
                reply = self.code._render(self.env, self.compiled, source, {**context, "tools": tools, "messages": messages,
                                                                             "add_generation_prompt": generation},
                                          self.max_output)
                answers.append((reply[:1], reply[5:].decode("utf-8", "surrogatepass")))
                if reply[:1] != b"o":
                    break
            out.append(answers)
        return out


def one_round(encoder: Any, tokenizer: Any, convs: List[Any], pair_encoder: Any, pairs: List[Any]) -> dict:
    """Conversations/s encoded, CPU us per conversation encoded, preference pairs/s encoded (PairEncoder, as DPO's
    preparation), whole conversations/s rendered one call each (chat, prompt-eval)."""
    from dsrecipes.boundary.chat_sandbox import render

    started, cpu = time.perf_counter(), time.process_time() + renderer_cpu()
    for i in range(0, len(convs), 256):
        batch = encoder.encode_arrays(convs[i:i + 256])
        assert not batch.bad, batch.bad[:1]
    encode_s = time.perf_counter() - started
    encode_cpu = time.process_time() + renderer_cpu() - cpu
    started = time.perf_counter()
    for i in range(0, len(pairs), 256):
        assert not any(isinstance(row, Exception) for row in pair_encoder.encode_batch(pairs[i:i + 256]))
    pairs_s = time.perf_counter() - started
    messages = [[{"role": "user" if t.role.value == "user" else "assistant", "content": t.content}
                 for t in c.turns] for c in convs]
    started = time.perf_counter()
    for m in messages:
        render(tokenizer, m)
    render_s = time.perf_counter() - started
    return {"encode_conv_per_s": len(convs) / encode_s, "encode_cpu_us_per_conv": encode_cpu / len(convs) * 1e6,
            "encode_pairs_per_s": len(pairs) / pairs_s, "render_per_s": len(convs) / render_s}


def setup(args: argparse.Namespace, result: Result) -> tuple:
    """(encoder, tokenizer, conversations, pair encoder, pairs) on SmolLM2's own template (else a ChatML one)."""
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.render.preference_encode import PairEncoder, iter_pairs
    from dsrecipes.data.render.tokenize import Encoder
    from dsrecipes.data.sources.badrows import BadRowReport
    from dsrecipes.data.sources.registry import resolve_sources

    smol = Path.home() / ".cache" / "dsrecipes" / "models" / "SmolLM2-135M-Instruct"
    model = smol if (smol / "tokenizer.json").is_file() else REPO / "dsrecipes" / "assets" / "tiny_tokenizer"
    cfg = compose_and_load(["debug=fast", "template=tokenizer", f"model.path={model}"])
    tokenizer = load_tokenizer(cfg)
    if model != smol:
        result.note(f"SmolLM2 is not at {smol}: the tiny tokenizer with a ChatML template instead")
        tokenizer.chat_template = CHATML
    pair_cfg = compose_and_load(["debug=fast", "template=tokenizer", f"model.path={model}", "objective=dpo",
                                 "objective.reference=live", "dataset=sample_pairs", "data.cutoff_len=256"])
    source = resolve_sources(pair_cfg.dataset, [])[0]
    pairs = list(iter_pairs(source, BadRowReport("skip", 1.0), max(8, args.n // 3), pair_cfg.dataset.max_row_bytes))
    return Encoder(tokenizer, cfg), tokenizer, conversations(args.n), PairEncoder(tokenizer, pair_cfg), pairs


def main(argv: List[str]) -> int:
    parser = add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.rounds = 40, 1
    from dsrecipes.boundary import chat_sandbox

    with Result("bench_chat_sandbox", args) as result:
        encoder, tokenizer, convs, pair_encoder, pairs = setup(args, result)
        renderers = {"sandbox": chat_sandbox._RENDERER, "in_process": InProcess()}
        got: dict = {mode: [] for mode in renderers}
        for r in range(args.rounds):
            for mode in sorted(renderers, reverse=r % 2 == 1):  # alternating order: drift hits both alike
                chat_sandbox._RENDERER = renderers[mode]
                try:
                    got[mode].append(one_round(encoder, tokenizer, convs, pair_encoder, pairs))
                finally:
                    chat_sandbox._RENDERER = renderers["sandbox"]
                result.row({"round": r, "mode": mode, "conversations": len(convs), "pairs": len(pairs),
                            **{k: round(v, 1) for k, v in got[mode][-1].items()}})
        med = {mode: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for mode, rows in got.items()}
        for mode, values in med.items():
            result.row({"mode": mode, **{f"median_{k}": round(v, 1) for k, v in values.items()}})
        result.row({**{f"sandbox_vs_in_process_{k}": round(med["sandbox"][k] / med["in_process"][k], 3)
                       for k in med["sandbox"]}, "load_average": [round(x, 2) for x in os.getloadavg()]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
