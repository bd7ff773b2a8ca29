"""What every benchmark shares (not a benchmark itself): the `--smoke` and `--out` options and its result file.

Owner: benchmarks/. Each script in benchmarks/ calls `add_args(parser)` and builds one `Result`:

  --smoke   tiny sizes, a few seconds: every phase of the benchmark runs (imports, paths, the functions it calls,
            the result file), none of its numbers mean anything; tests/test_benchmarks_smoke.py runs each one so;
  --out D   where the result file goes (default: a fresh temporary directory, printed).

Importing it puts this checkout on sys.path (after the script's own folder) and on PYTHONPATH (for the processes a
benchmark starts): a benchmark measures the dsrecipes beside it, installed or not.

`Result.note(...)` is how a benchmark says it substituted data, skipped a phase or changed what it measures: the note
is printed on its output (`NOTE: ...`) and kept in the result file's `notes`, never only one of the two. The result
file is `<out>/<benchmark>.json` (rows, notes, arguments, smoke or not), written whole (a temporary file renamed
onto it) when the benchmark ends, also when it ends on an error (with `"error"` set).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the benchmarks measure this checkout's dsrecipes, installed or not
    sys.path.insert(1, str(REPO))
if str(REPO) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):  # and the `python -m dsrecipes` it starts
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
# At exit (after the other exit handlers, registered later), what is still alive is frozen: the interpreter's final
# collections then skip it. With torch/transformers/deepspeed loaded they cost ~1.3 CPU s per process otherwise
# (measured: 1.3-1.5 s between the end of main and the process's end, 0.2 s frozen). Nothing measured is affected.
atexit.register(gc.freeze)


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes, seconds: check that every phase runs (the numbers mean nothing)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for the result file (default: a fresh temporary directory)")
    return parser


class Result:
    """One benchmark run's rows and notes, and its result file."""

    def __init__(self, name: str, args: Optional[argparse.Namespace] = None) -> None:
        self.name = name
        self.smoke = bool(getattr(args, "smoke", False))
        out = getattr(args, "out", None)
        self.out = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix=f"{name}_"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args or argparse.Namespace()).items()}
        self.rows: List[Dict[str, Any]] = []
        self.notes: List[str] = []
        self.extra: Dict[str, Any] = {}
        self.started = time.time()
        if self.smoke:
            self.note("smoke mode: tiny sizes; the numbers below check that every phase runs, they measure nothing")

    @property
    def path(self) -> Path:
        return self.out / f"{self.name}.json"

    def note(self, message: str) -> None:
        print(f"NOTE: {message}", flush=True)
        self.notes.append(message)

    def row(self, row: Dict[str, Any], echo: bool = True) -> Dict[str, Any]:
        if echo:
            print(json.dumps(row, default=str), flush=True)
        self.rows.append(row)
        return row

    def write(self, error: Optional[str] = None) -> Path:
        body = {"benchmark": self.name, "smoke": self.smoke, "args": self.args, "argv": sys.argv,
                "started": self.started, "wall_s": round(time.time() - self.started, 2), "notes": self.notes,
                "rows": self.rows, **self.extra}
        if error is not None:
            body["error"] = error
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(body, indent=1, default=str), encoding="utf-8")
        os.replace(tmp, self.path)
        print(f"result file: {self.path}", flush=True)
        return self.path

    def __enter__(self) -> "Result":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self.write()
        elif issubclass(kind, SystemExit) and exc.code in (0, None):
            self.write()
        else:
            self.write(error=f"{kind.__name__}: {exc}")
