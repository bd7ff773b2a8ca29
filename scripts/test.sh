#!/usr/bin/env bash
# The README's test command: install (idempotent), validate every recipe x group option, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" -e ".[test,mpi,mlflow,wandb]"
python -m dsrecipes validate --all
python -m pytest -q "$@"
