"""`python -m dsrecipes`: the command line (cli.py), ended as the `dsrecipes` console script ends (cli.entry).

A Ctrl-C while cli.py itself is imported (before its guard is in place) ends as the guard ends one: `interrupted`,
exit 130, no traceback.
"""

import sys

if __name__ == "__main__":
    try:
        from dsrecipes.cli import entry
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    entry()
