"""Reading checkpoint pickles without running them: `torch.load(weights_only=True)` with a short allow-list, and a
static screen of every pickle a checkpoint holds before DeepSpeed (which unpickles with weights_only=False) sees it.

`load` is what our own readers use (RNG states, ZeRO-0/1/2 model states for export): only tensors, containers,
numbers and the allow-listed numpy types below can come out of it; anything else is one message naming the file.
`screen` disassembles each `*.pt` of a checkpoint (torch.serialization.get_unsafe_globals_in_checkpoint: nothing is
executed) and refuses a file that would import anything beyond the same allow-list plus what DeepSpeed's own files
name; a pickle using opcodes torch's static reader does not follow (STACK_GLOBAL and the like, which torch.save
never writes) is refused as well. It runs for a checkpoint trusted with --trust-checkpoint (one signed by this user
was written by this user's runs), so a pickle payload is refused even then.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any, List

import numpy as np

from dsrecipes.core.errors import UserError

# numpy's RNG state (np.random.get_state()) is a tuple holding a uint32 array.
_NUMPY = [np.dtype, np.ndarray, type(np.dtype(np.uint32)), np._core.multiarray._reconstruct]
# Names DeepSpeed's optimizer / universal checkpoint files contain (classes of plain data, no side effects).
DEEPSPEED_NAMES = {
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler", "deepspeed.utils.tensor_fragment.fragment_address",
}


def beyond_allowed(found: Any) -> List[str]:
    """The names a torch.save pickle imports (`get_unsafe_globals_in_checkpoint`) beyond the allow-lists: numpy's RNG
    types and DeepSpeed's plain data classes. Compared by name, never by entering torch's `safe_globals` around the
    scan: that block's exit takes numpy's types off torch's list even where an enclosing load (`load` below) had put
    them there, and the load then refused a trusted checkpoint's RNG file (tests/test_hostile_checkpoint.py)."""
    allowed = {f"{g.__module__}.{g.__name__}" for g in _NUMPY} | DEEPSPEED_NAMES
    return sorted(name for name in found if name not in allowed)


def load(path: Path, checked: Any = None) -> Any:
    """torch.load(weights_only=True) with numpy's RNG types allowed; a file that needs more is refused.

    A zip-format file (what torch.save writes) is memory-mapped: its tensors are read from the page cache when they
    are used, not copied into fresh memory up front. Export reads only the module weights of a ZeRO-0 model-states
    file that also holds the optimizer's fp32 master and moments (SmolLM2-135M: 1.6 GB): mapped, 0.3 s of CPU where
    reading it all took 7-15 s on the 2-core test machine. The mapping is private (copy-on-write): nothing written
    to a tensor reaches the file. A legacy (pre-zip) file cannot be mapped and is read as before.

    `checked` (point_of_use.CheckedCheckpoint): the file is read from the descriptor its signed hash was checked on,
    right before loading."""
    import torch  # lazy: the launching process checks checkpoints with this module and never loads them

    try:
        with torch.serialization.safe_globals(_NUMPY):
            if checked is not None:
                return checked.load(path, map_location="cpu", weights_only=True, mmap=True)
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as exc:
        first = str(exc).split("\n")[0]
        raise UserError(f"{path}: refusing to unpickle it: it holds more than tensors and plain data ({first})")


def unsafe_globals(path: Path) -> List[str]:
    """What `path` (a torch.save file) would import beyond the allow-lists, found without unpickling it."""
    import torch  # lazy: only a checkpoint trusted on the command line is screened

    return beyond_allowed(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))


def screen(tag_dir: Path) -> None:
    """Every `*.pt` below a checkpoint imports only allow-listed names; else UserError naming file and names."""
    for path in sorted(Path(tag_dir).rglob("*.pt")):
        try:
            names = unsafe_globals(path)
        except Exception as exc:  # noqa: BLE001 - a pickle the static reader cannot follow is not loaded
            raise UserError(f"{path}: not a torch.save file that can be checked ({type(exc).__name__}: {exc}); "
                            "refusing to load it")
        if names:
            raise UserError(f"{path}: refusing to load it: its pickle imports {', '.join(names[:5])}, which a "
                            "checkpoint written by dsrecipes never holds (a pickle that runs code when loaded)")
