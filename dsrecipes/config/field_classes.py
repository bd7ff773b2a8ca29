"""Every schema field that can hold text, by what its value may reach (issue 50: nothing a recipe sets reaches outside
the run directory or the machine unless the user's own command line or environment named it).

    FIELDS[dotted key] -> FieldClass      (`[]` stands for every element of a list of sources)

USER_NAMED fields name something outside the run directory or the machine (a tracking server that receives the
user's MLFLOW_TRACKING_TOKEN, a directory written to, a file read and quoted, a rendezvous host): their value may come
from the command line, the environment (MLFLOW_TRACKING_URI, ...) or the config tree (conf/, $DSRECIPES_HOME), never
from a shared recipe (a `recipe=` file by path or from a $DSRECIPES_RECIPES folder). RUN_DIR (trainer.output_dir)
is the run directory itself: a shared recipe may name a relative path inside the working directory only.
config/safety.py enforces both on each composition, with the provenance config/hydra_app.py finds in Hydra's
defaults list - before anything connects, reads or writes. tests/test_trust_outside.py checks that every text field
of the schema is in FIELDS, so a new field fails until it is classified here. Outside the schema, Hydra's own
`hydra.run.dir` / `hydra.sweep.dir` are closed to recipes already (config/safety.py: the `hydra` node must equal
the baseline; only command-line overrides may set those two).
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum
from pathlib import PurePosixPath
from typing import Any, Dict, Iterator, List, Tuple

from dsrecipes.core.schema import TrainConfig


class FieldClass(str, Enum):
    user_named = "user-named only"  # outside the run directory or the machine: command line / environment / conf tree
    run_dir = "run directory"  # a shared recipe: a relative path inside the working directory only
    command_line = "command line only"  # chooses code the batch job runs (config/safety.py COMMAND_LINE_ONLY)
    read_input = "read-only input"  # read, never written; recipes name their data and model (checked where read)
    boundary = "allow-listed at the boundary"  # each element checked by its own positive list (boundary/)
    not_a_path = "not a path or address"


_COLUMNS = ("messages", "role", "content", "system", "tools", "id", "instruction", "input", "output", "history",
            "prompt", "chosen", "rejected")

FIELDS: Dict[str, FieldClass] = {
    # reaches outside the run directory or the machine
    "trainer.tracking_uri": FieldClass.user_named,  # MLflow store: receives MLFLOW_TRACKING_TOKEN; file: writes there
    "data.cache_dir": FieldClass.user_named,  # prepared-data cache: written, and its tokens trained on
    "offload.nvme_path": FieldClass.user_named,  # DeepSpeed's swap files are written there
    "launcher.hostfile": FieldClass.user_named,  # read (and its hosts reached over ssh/pdsh)
    "launcher.master_addr": FieldClass.user_named,  # the rendezvous host every rank connects to
    "launcher.rdzv_endpoint": FieldClass.user_named,  # torchrun's rendezvous host:port
    "trainer.output_dir": FieldClass.run_dir,
    "launcher.slurm_venv": FieldClass.command_line,
    "launcher.slurm_conda_env": FieldClass.command_line,
    "launcher.slurm_modules": FieldClass.command_line,
    # read-only inputs a recipe names (URLs: s3:// and hf:// only, credentials from the user's settings:
    # data/sources/remote.py; checkpoints are loaded only when signed or trusted: boundary/trust.py)
    "dataset.paths": FieldClass.read_input,
    "dataset.val_paths": FieldClass.read_input,
    "dataset.sources[].paths": FieldClass.read_input,
    "dataset.registry": FieldClass.read_input,
    "data.shard_dir": FieldClass.read_input,
    "model.path": FieldClass.read_input,
    "model.tokenizer_path": FieldClass.read_input,
    "trainer.resume_from": FieldClass.read_input,
    "objective.reward_model": FieldClass.read_input,  # objective=grpo: loaded with the model-directory checks
    # allow-listed element by element
    "launcher.env": FieldClass.boundary,  # boundary/rank_env.py
    "launcher.extra_args": FieldClass.boundary,  # boundary/launcher_args.py
    "launcher.slurm_sbatch_args": FieldClass.boundary,  # boundary/batch_script.py
    "launcher.include": FieldClass.boundary,  # host[:slots] of the user's hostfile only (config/validate.py)
    "launcher.exclude": FieldClass.boundary,
    # names and text
    **{k: FieldClass.not_a_path for k in (
        "dataset.name", "dataset.roles", "dataset.use", "dataset.sources[].name", "dataset.sources[].roles",
        "dataset.split.take", "dataset.split.shares", "dataset.split.pin", "dataset.sources[].share[].take",
        "dataset.sources[].share[].pinned", "dataset.sources[].share[].shares",
        "model.name", "model.revision", "model.arch", "model.lora.target_modules", "template.separator",
        "template.default_system", "trainer.experiment", "launcher.slurm_partition", "launcher.slurm_account",
        "objective.rewards[].name", "objective.rewards[].pattern", "trainer.micro_batch_size",  # int or "auto"
        *(f"{p}.columns.{c}" for p in ("dataset", "dataset.sources[]") for c in _COLUMNS))},
}


def of(cls: FieldClass) -> List[Tuple[str, ...]]:
    """The key paths of one class (no list elements: none of the restricted classes is inside a list)."""
    return [tuple(k.split(".")) for k, v in FIELDS.items() if v is cls and "[]" not in k]


def text_fields(cls: Any = None, prefix: str = "") -> Iterator[str]:
    """Every dotted key of the schema whose type can hold text (str, Any, or a list/mapping of them)."""
    cls = TrainConfig if cls is None else cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind, key = hints[f.name], f"{prefix}{f.name}"
        inner = [a for a in typing.get_args(kind) if a is not type(None)]
        if dataclasses.is_dataclass(kind):
            yield from text_fields(kind, key + ".")
        elif inner and dataclasses.is_dataclass(inner[0]):
            yield from text_fields(inner[0], key + "[].")
        elif _holds_text(kind):
            yield key


def _holds_text(kind: Any) -> bool:
    if kind in (str, Any):
        return True
    return any(_holds_text(a) for a in typing.get_args(kind))


def inside_working_dir(value: Any) -> bool:
    """A relative path that stays inside the working directory (no `..`, no `~`, no drive or scheme)."""
    if not isinstance(value, str) or not value or value.startswith("~") or "://" in value or ":" in value[:3]:
        return False
    path = PurePosixPath(value)
    return not path.is_absolute() and ".." not in path.parts
