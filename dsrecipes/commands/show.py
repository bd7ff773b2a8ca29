"""`dsrecipes show [overrides] [--world-size N]`: the resolved config and its DeepSpeed JSON."""

from __future__ import annotations

import json
from typing import List

import yaml

from dsrecipes.commands.args import override_parser, parse, positive_int
from dsrecipes.config.defaults import lr_scale_applied, lr_source, model_rate, with_derived_defaults
from dsrecipes.config.load import compose_and_load
from dsrecipes.core.schema import TrainConfig
from dsrecipes.core.topology import resolve_topology
from dsrecipes.core.typed import config_to_dict
from dsrecipes.data.sources.registry import sample_replaced
from dsrecipes.run.ds_config import build_ds_config
from dsrecipes.run.micro_batch import needs_number


def main(argv: List[str]) -> int:
    parser = override_parser("show", "Print the resolved config and the DeepSpeed JSON for a world size.")
    parser.add_argument("--world-size", type=positive_int, default=None,
                        help="data-parallel ranks (default: the launcher's)")
    parser.add_argument("--json-only", action="store_true", help="print only the DeepSpeed JSON")
    args = parse(parser, argv)
    cfg = compose_and_load(args.overrides, check_files=False)
    needs_number(cfg, "show the DeepSpeed JSON")
    world = args.world_size if args.world_size is not None else resolve_topology(cfg.launcher).world_size
    if not args.json_only:
        print("# resolved config")
        print(config_text(cfg))
        if sample_replaced(cfg.dataset):  # the sample's name and path are above, but a run reads what the user named
            named = " and ".join(n for n, v in (("dataset.use", cfg.dataset.use), ("dataset.sources", cfg.dataset.sources))
                                 if v)
            print(f"# data: a run reads {named}, not the bundled sample: dataset.name and dataset.paths above are not "
                  "read (dataset.mix_sample=true keeps the sample in the mix)\n")
        print(f"# DeepSpeed JSON at world size {world}")
        print("# (no \"scheduler\" section: the LR schedule is dsrecipes.rank.schedule, given to deepspeed.initialize)")
    print(json.dumps(build_ds_config(cfg, world), indent=2))
    return 0


def config_text(cfg: TrainConfig) -> str:
    """The config as the run directory's config.yaml will hold it (the derived defaults of config/defaults.py filled
    in: `optimizer.lr: null` is the model's own rate for the objective), the learning rate's line naming the key it came from when the
    command left optimizer.lr unset: `lr: 0.003  # model.tiny.finetune_lr (optimizer.lr unset)`, `lr: 5.0e-06  #
    model.finetune_lr x objective.lr_scale (5e-05 x 0.1 for dpo; optimizer.lr unset)`."""
    text = yaml.safe_dump(config_to_dict(with_derived_defaults(cfg)), sort_keys=False, allow_unicode=True)
    if cfg.optimizer.lr is not None:
        return text
    lines = text.splitlines()
    section = lines.index("optimizer:")
    at = next(i for i in range(section + 1, len(lines)) if lines[i].startswith("  lr: "))
    scale, kind = lr_scale_applied(cfg), cfg.objective.kind.value
    how = "" if scale is None else f"{model_rate(cfg):g} x {scale:g} for {kind}; "
    if cfg.model.path is None and cfg.objective.lr_scale != 1.0:  # the tiny model: random init, never scaled
        how = f"objective.lr_scale {cfg.objective.lr_scale:g} not applied to the tiny model; "
    lines[at] += f"  # {lr_source(cfg)} ({how}optimizer.lr unset)"
    return "\n".join(lines) + "\n"
