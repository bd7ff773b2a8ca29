"""`python -u -m dsrecipes.run.launch.ds_node ARGS`: DeepSpeed's per-node launcher, `deepspeed.launcher.launch`, with the
same arguments and its own `main()`, unchanged; only its `import deepspeed` goes through `load_deepspeed` first.

`python -m deepspeed.launcher.launch` imports DeepSpeed's autotuner, which imports mlflow whenever mlflow is
installed (deepspeed_import.py): measured over one test suite's launches on the 2-core test machine, 4.5 CPU seconds
per launch that way against 2.6 this way, spent before any rank starts. The launcher never uses mlflow.

Its imports (DeepSpeed, torch) run with Python's cyclic collector off, as a rank's do (rank/worker.py): what they
leave alive is frozen out of later collections, and the collector is on again before the ranks start.
"""

from __future__ import annotations

import gc

from dsrecipes.core.deepspeed_import import load_deepspeed


def main() -> None:
    gc.disable()
    load_deepspeed()
    from deepspeed.launcher import launch  # reads sys.argv, as `python -m deepspeed.launcher.launch` does

    gc.freeze()
    gc.enable()
    launch.main()


if __name__ == "__main__":
    main()
