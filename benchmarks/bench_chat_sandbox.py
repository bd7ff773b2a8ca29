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
* render: `chat_sandbox.render` of each whole conversation once.
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


def one_round(encoder: Any, tokenizer: Any, convs: List[Any], render: Any) -> tuple:
    """(conversations/s encoded, CPU us per conversation encoded, whole conversations/s rendered)."""
    started, cpu = time.perf_counter(), time.process_time() + renderer_cpu()
    for i in range(0, len(convs), 256):
        batch = encoder.encode_arrays(convs[i:i + 256])
        assert not batch.bad, batch.bad[:1]
    encode_s = time.perf_counter() - started
    encode_cpu = time.process_time() + renderer_cpu() - cpu
    messages = [[{"role": "user" if t.role.value == "user" else "assistant", "content": t.content}
                 for t in c.turns] for c in convs]
    started = time.perf_counter()
    for m in messages:
        render(tokenizer, m)
    render_s = time.perf_counter() - started
    return len(convs) / encode_s, encode_cpu / len(convs) * 1e6, len(convs) / render_s


def main(argv: List[str]) -> int:
    parser = add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.smoke:
        args.n, args.rounds = 40, 1
    from dsrecipes.boundary.chat_sandbox import render
    from dsrecipes.config.load import compose_and_load
    from dsrecipes.core.tokenizer import load_tokenizer
    from dsrecipes.data.render.tokenize import Encoder

    with Result("bench_chat_sandbox", args) as result:
        smol = Path.home() / ".cache" / "dsrecipes" / "models" / "SmolLM2-135M-Instruct"
        model = smol if (smol / "tokenizer.json").is_file() else REPO / "dsrecipes" / "assets" / "tiny_tokenizer"
        cfg = compose_and_load(["debug=fast", "template=tokenizer", f"model.path={model}"])
        tokenizer = load_tokenizer(cfg)
        if model != smol:
            result.note(f"SmolLM2 is not at {smol}: the tiny tokenizer with a ChatML template instead")
            tokenizer.chat_template = CHATML
        encoder = Encoder(tokenizer, cfg)
        convs = conversations(args.n)
        from dsrecipes.boundary import chat_sandbox

        renderers = {"sandbox": chat_sandbox._RENDERER, "in_process": InProcess()}
        got: dict = {mode: [] for mode in renderers}
        for r in range(args.rounds):
            for mode in sorted(renderers, reverse=r % 2 == 1):  # alternating order: drift hits both alike
                chat_sandbox._RENDERER = renderers[mode]
                try:
                    rate, cpu_us, render_rate = one_round(encoder, tokenizer, convs, render)
                finally:
                    chat_sandbox._RENDERER = renderers["sandbox"]
                got[mode].append((rate, cpu_us, render_rate))
                result.row({"round": r, "mode": mode, "conversations": len(convs), "encode_conv_per_s": round(rate, 1),
                            "encode_cpu_us_per_conv": round(cpu_us, 1), "render_per_s": round(render_rate, 1)})
        med = {mode: [statistics.median(x[j] for x in rows) for j in range(3)] for mode, rows in got.items()}
        for mode, (rate, cpu_us, render_rate) in med.items():
            result.row({"mode": mode, "median_encode_conv_per_s": round(rate, 1),
                        "median_encode_cpu_us_per_conv": round(cpu_us, 1), "median_render_per_s": round(render_rate, 1)})
        sand, base = med["sandbox"], med["in_process"]
        result.row({"sandbox_vs_in_process_encode_throughput": round(sand[0] / base[0], 3),
                    "sandbox_vs_in_process_encode_cpu": round(sand[1] / base[1], 3),
                    "sandbox_vs_in_process_render_throughput": round(sand[2] / base[2], 3),
                    "load_average": [round(x, 2) for x in os.getloadavg()]})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
