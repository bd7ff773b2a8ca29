"""The bare DeepSpeed loop of benchmarks/gpu_compare.py (not a benchmark itself): the floor dsrecipes is compared with.

Owner: benchmarks/. One JSON argument (model directory, DeepSpeed JSON, micro_batch, grad_accum, seq, steps, cuda,
result path): the model directory's weights under `deepspeed.initialize` with that JSON (its batch sizes set to
micro_batch and grad_accum: gpu_compare retries a run that ran out of memory at half the micro-batch), trained on a
pool of random token batches of shape (micro_batch, seq) with `labels=input_ids`, grad_accum of them per optimizer
step; the steps after the first third are timed. Writes {tokens_per_s, step_s, steps} to the result path. gpu_compare starts it as its own process on a GPU and calls `main([json])` in its
own process for the CPU dry run (--smoke).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import _harness  # noqa: F401  (this checkout on sys.path)


def main(argv: Optional[List[str]] = None) -> None:
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    import torch
    from transformers import AutoModelForCausalLM

    from dsrecipes.core.deepspeed_import import load_deepspeed
    from dsrecipes.core.distributed import skip_shm_comm_op

    deepspeed = load_deepspeed()
    cuda = spec["cuda"]
    config = json.loads(Path(spec["ds_json"]).read_text())
    accum = spec.get("grad_accum", 1)
    config.update(train_micro_batch_size_per_gpu=spec["micro_batch"], gradient_accumulation_steps=accum,
                  train_batch_size=spec["micro_batch"] * accum)  # one rank
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16 if cuda else torch.float32,
                                                 attn_implementation="sdpa")
    if not cuda:
        skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(1)
    vocab = min(model.config.vocab_size, 8192)
    pool = [torch.randint(0, vocab, (spec["micro_batch"], spec["seq"]), generator=gen).to(engine.device)
            for _ in range(4)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    steps, start = spec["steps"], spec.get("timed_after", spec["steps"] // 3)  # gpu_compare's, as for the others
    t0 = time.perf_counter()
    for step in range(steps):
        if step == start:
            sync()
            t0 = time.perf_counter()
        for micro in range(accum):
            batch = pool[(step * accum + micro) % len(pool)]
            engine.backward(engine(input_ids=batch, labels=batch, use_cache=False).loss)
            engine.step()
    sync()
    step_s = (time.perf_counter() - t0) / max(steps - start, 1)
    result = {"tokens_per_s": spec["micro_batch"] * accum * spec["seq"] / step_s, "step_s": step_s, "steps": steps,
              "settings": {"ds_config": str(spec["ds_json"]), "batches": "random tokens, labels = inputs"}}
    Path(spec["result"]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
