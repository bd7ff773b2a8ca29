"""`python -u -m dsrecipes.run.launch.ds_node ARGS`: DeepSpeed's per-node launcher, `deepspeed.launcher.launch`, with the
same arguments and its own `main()`, unchanged; only its `import deepspeed` goes through `load_deepspeed` first.

`python -m deepspeed.launcher.launch` imports DeepSpeed's autotuner, which imports mlflow whenever mlflow is
installed (deepspeed_import.py): measured over one test suite's launches on the 2-core test machine, 4.5 CPU seconds
per launch that way against 2.6 this way, spent before any rank starts. The launcher never uses mlflow.

Its imports (DeepSpeed, torch) run with Python's cyclic collector off, as a rank's do (rank/worker.py): what they
leave alive is frozen out of later collections, and the collector is on again before the ranks start.

Its wait for the ranks polls them every POLL_S instead of every second: `main()` checks each rank with
`Popen.poll()` (no blocking wait) and then calls `time.sleep(1)`, also after it has seen the last rank end, so
every run ended 1 to 2 s after its last rank (measured on a run's launcher.log: the second rank's end noted 1.0 s
after the first's, result.json 1.5 s after that), and a failed rank's peers were stopped up to 1 s late. Its module
global `time` is replaced by `_QuickPoll`, which is the `time` module but for a shorter sleep; a poll of a few
ranks is one waitpid(WNOHANG) each.
"""

from __future__ import annotations

import gc
import time
from types import ModuleType
from typing import Any

from dsrecipes.core.deepspeed_import import load_deepspeed

POLL_S = 0.1  # how often the wait for the ranks looks at them (DeepSpeed's own: 1 s)


class _QuickPoll(ModuleType):
    """The `time` module for DeepSpeed's launcher, whose only sleep is its wait loop's `time.sleep(1)`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(min(seconds, POLL_S))


def main() -> None:
    gc.disable()
    load_deepspeed()
    from deepspeed.launcher import launch  # reads sys.argv, as `python -m deepspeed.launcher.launch` does

    launch.time = _QuickPoll("time")
    gc.freeze()
    gc.enable()
    launch.main()


if __name__ == "__main__":
    main()
