"""`trainer.micro_batch_size=auto`, the GPU side: the largest micro-batch that trains on one GPU without running out
of memory, found by trying sizes (`python -m dsrecipes.rank.batch_probe`, started by run/micro_batch.py on the
launching node; the launching process itself never imports torch).

The search (`largest_fitting`) takes a "does this micro-batch fit" callable: sizes double from 1 until one does not
fit (or `limit`), then bisection between the largest that fitted and the smallest that did not. On the GPU a size
fits when two optimizer steps of the run's own model, ZeRO JSON and objective on that many full-length rows
(`data.cutoff_len` tokens each, the worst case the loader can hand a rank; several samples per row with
`data.packing`) end without CUDA running out of memory and with the reserved memory under HEADROOM of the device.
Gradient accumulation keeps its setting: it adds no memory per micro-batch, so the optimizer step trains
micro_batch x grad_accum x world rows as always. The probe is one process on one GPU: ZeRO over several GPUs
holds less per GPU than it measured, so the size it finds is on the safe side there.

Protocol: stdin is one JSON object {"config": the run's config, "ds_config": its DeepSpeed JSON for one rank,
"limit": the largest size to try}; the last stdout line is the JSON record; exit 2 with one message on stderr
when even one row does not fit or there is no CUDA GPU.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import sys
from typing import Any, Callable, Dict, List, Tuple

import torch

from dsrecipes.config.load import from_dict
from dsrecipes.core.deepspeed_import import load_deepspeed
from dsrecipes.core.distributed import init_distributed
from dsrecipes.core.schema import TrainConfig
from dsrecipes.modeling.model import build_model, load_tokenizer, trainable_parameters
from dsrecipes.objectives import build_objective

HEADROOM = 0.95  # of the device's memory: what fragmentation and a longer run may still need
STEPS = 2  # the first optimizer step allocates the optimizer's state, the second runs with it


def largest_fitting(fits: Callable[[int], bool], limit: int) -> Tuple[int, List[Tuple[int, bool]]]:
    """(the largest size in [1, limit] that fits, 0 when 1 does not; every (size, fitted) tried, in order).
    Assumes that a size fits when a larger one does."""
    tried: List[Tuple[int, bool]] = []

    def attempt(size: int) -> bool:
        tried.append((size, bool(fits(size))))
        return tried[-1][1]

    if not attempt(1):
        return 0, tried
    good, bad = 1, None
    while bad is None and good < limit:
        size = min(2 * good, limit)
        good, bad = (size, None) if attempt(size) else (good, size)
    while bad is not None and bad - good > 1:
        size = (good + bad) // 2
        good, bad = (size, bad) if attempt(size) else (good, size)
    return good, tried


def fits_unless_oom(step: Callable[[int], None], after_oom: Callable[[], None]) -> Callable[[int], bool]:
    """A `fits` callable for `largest_fitting`: `step(size)` trains at that size; running out of device memory
    (torch.OutOfMemoryError) means "does not fit", after `after_oom()` cleaned up. Other errors propagate."""
    def fits(size: int) -> bool:
        try:
            step(size)
        except torch.OutOfMemoryError:
            after_oom()
            return False
        return True

    return fits


def probe_rows(cfg: TrainConfig, size: int, vocab: int) -> List[Dict[str, Any]]:
    """`size` full-length rows (`data.cutoff_len` tokens, every label trained; two samples each when packing)."""
    n = cfg.data.cutoff_len
    ids = [(7 * i + 3) % max(vocab - 1, 1) + 1 for i in range(n)]
    if cfg.data.packing:
        half = n // 2
        return [{"ids": [f"p{r}a", f"p{r}b"], "input_ids": ids, "labels": ids,
                 "position_ids": list(range(half)) + list(range(n - half))} for r in range(size)]
    return [{"ids": [f"p{r}"], "input_ids": ids, "labels": ids} for r in range(size)]


class Trainer:
    """The run's model, engine and objective on this GPU; rebuilt after an out-of-memory step (an engine that ran
    out of memory mid-step is not trusted again)."""

    def __init__(self, cfg: TrainConfig, ds_config: Dict[str, Any]) -> None:
        self.cfg, self.ds_config = cfg, ds_config
        self.tokenizer = load_tokenizer(cfg)
        self.engine = self.objective = None

    def build(self) -> None:
        deepspeed = load_deepspeed()
        model = build_model(self.cfg, self.tokenizer, self.ds_config)
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable_parameters(model),
                                                    config=self.ds_config)
        self.objective = build_objective(self.cfg, self.tokenizer)
        self.objective.attach(self.cfg, self.tokenizer, self.engine)

    def step(self, size: int) -> None:
        """Train at `size` on the GPU; running out of memory, or reserving more than HEADROOM of it, raises
        torch.OutOfMemoryError."""
        if self.engine is None:
            self.build()
        torch.cuda.reset_peak_memory_stats()
        self.train(size)
        torch.cuda.synchronize()
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        if torch.cuda.max_memory_reserved() > HEADROOM * total:
            raise torch.OutOfMemoryError(f"{torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved")

    def train(self, size: int) -> None:
        """STEPS optimizer steps on `size` probe rows, as train.py's loop runs a micro-batch (any device)."""
        rows = probe_rows(self.cfg, size, len(self.tokenizer))
        for _ in range(STEPS):
            loss, _ = self.objective.loss(self.engine, self.objective.collate(rows), self.engine.device)
            self.engine.backward(loss)
            self.engine.step()

    def drop(self) -> None:
        self.engine = self.objective = None
        gc.collect()
        torch.cuda.empty_cache()


def probe(cfg: TrainConfig, ds_config: Dict[str, Any], limit: int) -> Dict[str, Any]:
    trainer = Trainer(cfg, ds_config)
    size, tried = largest_fitting(fits_unless_oom(trainer.step, trainer.drop), limit)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"micro_batch_size": size, "tried": tried, "limit": limit, "device": props.name,
            "device_gib": round(props.total_memory / 2**30, 1), "cutoff_len": cfg.data.cutoff_len,
            "packing": cfg.data.packing, "zero_stage": cfg.zero.stage, "headroom": HEADROOM}


def main() -> int:
    request = json.loads(sys.stdin.read())
    cfg, errors = from_dict(request["config"])
    if cfg is None or errors:
        print("; ".join(errors) or "trainer.micro_batch_size=auto: the probe got no config", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("trainer.micro_batch_size: auto is a GPU-only choice and this machine has no CUDA GPU; set a number",
              file=sys.stderr)
        return 2
    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, micro_batch_size=1, grad_accum=1))
    init_distributed()
    record = probe(cfg, request["ds_config"], int(request["limit"]))
    if record["micro_batch_size"] < 1:
        print(f"trainer.micro_batch_size=auto: one row of data.cutoff_len={cfg.data.cutoff_len} tokens does not fit "
              f"on this {record['device']} ({record['device_gib']} GiB); lower data.cutoff_len, or use zero=stage3, "
              "offload=cpu_optimizer or model.gradient_checkpointing=true", file=sys.stderr)
        return 2
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
