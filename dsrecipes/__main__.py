"""`python -m dsrecipes`: the command line (cli.py).

After the command returns, what is still alive is frozen out of the cyclic collector (gc.freeze): the interpreter's
last collections would otherwise walk every object torch, transformers and DeepSpeed created (~0.6-1.4 CPU s per
process). Every file was closed by its owner before this point; nothing else changes. A Ctrl-C while cli.py itself
is imported (before its guard is in place) ends as the guard ends one: `interrupted`, exit 130, no traceback.
"""

import gc
import sys

if __name__ == "__main__":
    try:
        from dsrecipes.cli import main
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    _code = main()
    gc.freeze()
    raise SystemExit(_code)
