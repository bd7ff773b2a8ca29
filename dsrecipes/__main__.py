"""`python -m dsrecipes`: the command line (cli.py).

After the command returns, what is still alive is frozen out of the cyclic collector (gc.freeze): the interpreter's
last collections would otherwise walk every object torch, transformers and DeepSpeed created (~0.6-1.4 CPU s per
process). Every file was closed by its owner before this point; nothing else changes. A Ctrl-C while cli.py itself
is imported (before its guard is in place) ends as the guard ends one: `interrupted`, exit 130, no traceback; one
after the command returned (its work done and reported, while torch and DeepSpeed tear down) ends the process at once
with the command's own exit code (was: a KeyboardInterrupt traceback or a death by SIGINT after `exported ...`).
"""

import gc
import os
import signal
import sys


def _exit_now(code: int):
    def handler(signum, frame):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    return handler

if __name__ == "__main__":
    try:
        from dsrecipes.cli import main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    _code = main()
    signal.signal(signal.SIGINT, _exit_now(_code))
    gc.freeze()
    raise SystemExit(_code)
