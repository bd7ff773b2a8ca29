"""Run every zero x offload x precision config through DeepSpeed's own parser at world sizes 1, 2 and 8.

A subprocess (see tests/test_ds_config.py): DeepSpeedConfig only honours a data-parallel world size when a process
group exists, so this script creates a single-process gloo group and hands DeepSpeed an mpu that reports N.
Prints one JSON line per checked config.

The 96 compositions are layered as `validate --all` layers its products (dsrecipes/config/matrix.py): the defaults
and each option's node come from real Hydra composes (1 + 13 instead of 96; each option is group-packaged and pulls
no other group, checked), each combination is the defaults with those four nodes swapped in, and is then loaded and
rule-checked exactly as a compose is (load_config). A few combinations are also composed by Hydra and must be equal.
"""

import copy
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
from dsrecipes.config.load import ConfigError, compose, hydra_context, load_config  # noqa: E402
from dsrecipes.config.matrix import as_container, package_of, pulls_groups  # noqa: E402
from dsrecipes.core.distributed import skip_shm_comm_op  # noqa: E402
from dsrecipes.run.ds_config import build_ds_config  # noqa: E402


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
CHOICES = {"zero": opts["zero"], "offload": opts["offload"], "precision": opts["precision"],
           "optimizer": ["adamw", "sgd"]}
EXTRA = ["trainer.grad_accum=2"]


def container(overrides):
    return as_container(compose(overrides))


with hydra_context():
    base = container(EXTRA)
    nodes = {}
    for group, options in CHOICES.items():
        for option in options:
            assert package_of(group, option) == group and not pulls_groups(group, option), (group, option)
            nodes[group, option] = container([f"{group}={option}"] + EXTRA)[group]
    combos = list(itertools.product(*CHOICES.values()))
    for combo in combos:
        overrides = [f"{g}={o}" for g, o in zip(CHOICES, combo)] + EXTRA
        data = copy.deepcopy(base)
        for group, option in zip(CHOICES, combo):
            data[group] = copy.deepcopy(nodes[group, option])
        if combo in (combos[0], combos[len(combos) // 2], combos[-1]):
            assert data == container(overrides), overrides  # layered = Hydra's own composition
        try:
            cfg = load_config(data, check_files=False, overrides=overrides)
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
