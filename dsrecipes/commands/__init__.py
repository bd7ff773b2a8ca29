"""Subcommands: one module per `dsrecipes NAME`, each exposing `main(argv) -> exit code` (routed by cli.py)."""
