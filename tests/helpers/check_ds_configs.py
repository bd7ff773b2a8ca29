"""Run every zero x offload x precision config through DeepSpeed's own parser at world sizes 1, 2 and 8.

A subprocess (see tests/test_ds_config.py): DeepSpeedConfig only honours a data-parallel world size when a process
group exists, so this script creates a single-process gloo group and hands DeepSpeed an mpu that reports N.
Prints one JSON line per checked config.
"""

import itertools
import json
import os
import sys

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", sys.argv[1] if len(sys.argv) > 1 else "29555")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")

import deepspeed  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402

from dsrecipes.config.groups import group_options  # noqa: E402
from dsrecipes.config.load import ConfigError, compose_and_load, hydra_context  # noqa: E402
from dsrecipes.distributed import skip_shm_comm_op  # noqa: E402
from dsrecipes.ds_config import build_ds_config  # noqa: E402


class DataParallelOnly:
    def __init__(self, n):
        self.n = n

    def get_data_parallel_world_size(self):
        return self.n

    def get_data_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0


skip_shm_comm_op()  # as every dsrecipes rank does: parsing configs needs no shared-memory op (a cold JIT build)
deepspeed.init_distributed(dist_backend="gloo")
opts = group_options()
with hydra_context():
    for zero, offload, precision, optimizer in itertools.product(opts["zero"], opts["offload"], opts["precision"],
                                                                   ["adamw", "sgd"]):
        overrides = [f"zero={zero}", f"offload={offload}", f"precision={precision}", f"optimizer={optimizer}",
                     "trainer.grad_accum=2"]
        try:
            cfg = compose_and_load(overrides, check_files=False)
        except ConfigError as exc:
            print(json.dumps({"overrides": overrides, "rejected": exc.problems}))
            continue
        for world in (1, 2, 8):
            ds = build_ds_config(cfg, world)
            parsed = DeepSpeedConfig(json.loads(json.dumps(ds)), mpu=DataParallelOnly(world))
            zc = parsed.zero_config
            print(json.dumps({
                "overrides": overrides, "world": world, "json": ds,
                "train_batch_size": parsed.train_batch_size,
                "micro": parsed.train_micro_batch_size_per_gpu, "accum": parsed.gradient_accumulation_steps,
                "stage": parsed.zero_optimization_stage,
                "offload_optimizer": None if zc.offload_optimizer is None else getattr(zc.offload_optimizer.device, "value", zc.offload_optimizer.device),
                "offload_param": None if zc.offload_param is None else getattr(zc.offload_param.device, "value", zc.offload_param.device),
                "bf16": parsed.bfloat16_config.enabled, "fp16": parsed.float16_config.enabled,
                "optimizer": parsed.optimizer_name, "scheduler": parsed.scheduler_name,
                "clip": parsed.gradient_clipping,
            }))
