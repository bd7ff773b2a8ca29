"""Build a DeepSpeed engine for every optimizer x offload x ZeRO stage the rules accept; print the optimizer class.

A subprocess (see tests/test_optimizers.py): one process, one single-rank gloo group, many engines, so DeepSpeed's
CPU ops (DeepSpeedCPUAdam, DeepSpeedCPULion) are JIT-built at most once (cached in ~/.cache/torch_extensions).
Prints one JSON line per combination: {"overrides", "basic" (the optimizer DeepSpeed built), "wrapper", "error"}, or
"rejected" (config rules) / "runtime" (this machine's rules, as `python -m dsrecipes` applies them before launching).
"""

import itertools
import json
import os
import sys

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
import torch  # noqa: E402

from dsrecipes.config.groups import group_options  # noqa: E402
from dsrecipes.config.load import ConfigError, compose_and_load, hydra_context  # noqa: E402
from dsrecipes.config.validate import check_runtime  # noqa: E402
from dsrecipes.core.distributed import skip_shm_comm_op  # noqa: E402
from dsrecipes.core.jit_ops import prepare_rank  # noqa: E402
from dsrecipes.core.tokenizer import tokenizer_dir  # noqa: E402
from dsrecipes.modeling.model import build_model, load_tokenizer, trainable_parameters  # noqa: E402
from dsrecipes.run.ds_config import build_ds_config  # noqa: E402

skip_shm_comm_op()  # as every dsrecipes rank does: no JIT build of the shared-memory op this check never calls
prepare_rank()  # as every rank does: ops build (and load) with the rank's flags, in the session's build directory
# DeepSpeedCPUAdam/CPULion ask py-cpuinfo on every construction, and py-cpuinfo starts a Python subprocess each time
# (~1.1 CPU s; 16 engines here, one per rank in a real run): asked once for this process, the same answer.
import functools  # noqa: E402

import cpuinfo  # noqa: E402

cpuinfo.get_cpu_info = functools.lru_cache(maxsize=None)(cpuinfo.get_cpu_info)
deepspeed.init_distributed(dist_backend="gloo")
torch.set_num_threads(1)
opts = group_options()
_tokenizers = {}  # tokenizer directory -> its tokenizer: one load, not one per engine (only optimizer/offload/zero
# differ between the combinations, so they all read the same directory)


def tokenizer(cfg):
    path = str(tokenizer_dir(cfg))
    if path not in _tokenizers:
        _tokenizers[path] = load_tokenizer(cfg)
    return _tokenizers[path]


# ZeRO-3 engines call gc.collect(), which walks every object alive: the ~1M objects of the imports above never become
# garbage, so they are moved out of the collector's sight (gc.freeze) and each collection walks only what came after.
import gc  # noqa: E402

gc.freeze()
wanted = sys.argv[2].split(",") if len(sys.argv) > 2 else opts["optimizer"]
with hydra_context():
    for optimizer, offload, zero in itertools.product(wanted, opts["offload"], opts["zero"]):
        overrides = [f"optimizer={optimizer}", f"offload={offload}", f"zero={zero}", "model.tiny.num_hidden_layers=1"]
        try:
            cfg = compose_and_load(overrides, check_files=False)
        except ConfigError as exc:
            print(json.dumps({"overrides": overrides, "rejected": exc.problems}), flush=True)
            continue
        problems = check_runtime(cfg, cuda_available=torch.cuda.is_available())
        if problems:  # what `python -m dsrecipes` says before starting anything on this machine
            print(json.dumps({"overrides": overrides, "runtime": problems}), flush=True)
            continue
        out = {"overrides": overrides}
        try:
            ds = build_ds_config(cfg, 1)
            model = build_model(cfg, tokenizer(cfg), ds)
            engine, optim, _, _ = deepspeed.initialize(model=model, model_parameters=trainable_parameters(model),
                                                       config=ds)
            basic = engine.basic_optimizer
            out.update(basic=f"{type(basic).__module__}.{type(basic).__name__}", wrapper=type(optim).__name__,
                       adam_w_mode=getattr(basic, "adam_w_mode", None), torch_adam=ds["optimizer"]["params"].get("torch_adam"))
            del engine, optim, model
        except Exception as exc:  # reported, the test decides
            out["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
        print(json.dumps(out), flush=True)
