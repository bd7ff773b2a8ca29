"""dsrecipes' own help texts: `dsrecipes train --help` (groups, options and keys, read from conf/ and the schema, so
they never go stale) and `dsrecipes --version` (the versions of what dsrecipes drives)."""

from __future__ import annotations

import dataclasses
import platform
import shutil
import textwrap
import typing
from importlib import metadata
from typing import Any, Dict, List

import yaml

from dsrecipes import __version__
from dsrecipes.config.groups import RECIPE_GROUP, group_options
from dsrecipes.config.hints import unwrap_optional
from dsrecipes.core.paths import PACKAGE_DIR, conf_dir
from dsrecipes.core.schema import TrainConfig

FLAGS = [
    ("-m, --multirun", "sweep: comma-separated values run one job each (zero=stage1,stage2), then a summary"),
    ("--cfg job", "print the composed config and exit (add --resolve to resolve interpolations)"),
    ("--info", "Hydra's view of the composition (search path, defaults tree)"),
    ("--hydra-help", "Hydra's own flags"),
    ("-h, --help", "this help"),
    ("--version", "dsrecipes, torch, deepspeed and transformers versions"),
]


def train_help() -> str:
    from dsrecipes.config.sources import (  # lazy: else `cli` imports hydra 0.12 s, omegaconf 0.06 s
        RECIPES_ENV,
        user_recipes,
    )

    width = min(shutil.get_terminal_size((120, 24)).columns, 120)
    intro = ("Compose a run from config groups (and a recipe), validate it, prepare the data, launch the ranks and "
             "train. Every mistake is one message and exit code 2, before anything starts.")
    out = ["usage: dsrecipes [train] [GROUP=OPTION ...] [KEY=VALUE ...] [flags]",
           "       dsrecipes train FILE.yaml [GROUP=OPTION ...] [KEY=VALUE ...] [flags]   (a recipe file of your own)",
           "", *textwrap.wrap(intro, width),
           "", "config groups (GROUP=OPTION; * marks the default):"]
    defaults = _default_options()
    for group, options in group_options().items():
        if group == RECIPE_GROUP:
            options = sorted(set(options) | set(user_recipes()))
        marked = [f"*{o}" if defaults.get(group) == o else o for o in options]
        out += _row(group, " ".join(marked), width)
    out += _row("", f"recipe=/path/to/file.yaml runs a recipe file; ${RECIPES_ENV}=DIR[:DIR...] adds recipe folders",
                width)
    out += ["", "keys (KEY=VALUE; `dsrecipes show` prints every resolved value, `dsrecipes ls` describes the options):"]
    for prefix, names in schema_rows().items():
        out += _row(prefix, " ".join(names), width)
    out += ["", "flags:"] + [f"  {flag:<18} {text}" for flag, text in FLAGS]
    out += ["", "examples:", "  dsrecipes zero=stage2 trainer.max_steps=100", "  dsrecipes recipe=cpu_zero2_two_ranks",
            "  dsrecipes -m optimizer.lr=1e-3,3e-3 trainer.report_to=[tensorboard,mlflow]"]
    return "\n".join(out)


def schema_rows() -> Dict[str, List[str]]:
    """{"trainer.": [micro_batch_size, ...], "model.lora.": [...], ...}: every key of the schema by parent."""

    rows: Dict[str, List[str]] = {}

    def walk(cls: Any, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        rows[prefix] = []
        for f in dataclasses.fields(cls):
            inner = unwrap_optional(hints[f.name])
            if dataclasses.is_dataclass(inner):
                walk(inner, f"{prefix}{f.name}.")
            else:
                rows[prefix].append(f.name)

    for f in dataclasses.fields(TrainConfig):
        walk(typing.get_type_hints(TrainConfig)[f.name], f"{f.name}.")
    return {k: v for k, v in rows.items() if v}


def _default_options() -> Dict[str, str]:
    entries = yaml.safe_load((conf_dir() / "train.yaml").read_text(encoding="utf-8"))["defaults"]
    return {str(k).split()[-1]: str(v) for d in entries if isinstance(d, dict) for k, v in d.items()}


def _row(label: str, text: str, width: int) -> List[str]:
    indent = " " * 16
    return textwrap.wrap(text, width=width, initial_indent=f"  {label:<13} ", subsequent_indent=indent,
                         break_on_hyphens=False)


def version_text() -> str:
    """dsrecipes and the versions of what it drives (from package metadata: nothing heavy is imported)."""

    lines = [f"dsrecipes {__version__} ({PACKAGE_DIR})"]
    for dist in ("torch", "deepspeed", "transformers", "hydra-core"):
        try:
            lines.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{dist} not installed")
    lines.append(f"python {platform.python_version()}")
    return "\n".join(lines)
