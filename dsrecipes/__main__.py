"""`python -m dsrecipes`: the command line (cli.py)."""

from dsrecipes.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
