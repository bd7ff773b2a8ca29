"""The whole fault-injection matrix of issue 43 as a table: `python scripts/fault_matrix.py [--only SUBSTRING] [--keep DIR]`.

Each case (tests/fault_cases.py) is a real `python -m dsrecipes` run with a fault injected after its first checkpoint;
a row says how many seconds the run took to end after the fault (every process of it), how many processes were left
at the bound, the exit code, where the same command resumed (newest checkpoint -> first step trained again, and how
many steps of the faulty session it replayed and compared: sample ids of every rank and losses), and what a user
would object to (empty: nothing). Exit 1 when any case has a problem. `--no-resume` skips the second run.
The same cases run under pytest with DSRECIPES_FAULT_MATRIX=1 (tests/test_fault_matrix.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fault_cases import Store, all_cases, problems, run_case  # noqa: E402
from tests.helpers.s3server import S3Server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="run the cases whose name contains this")
    parser.add_argument("--keep", type=Path, default=None, help="directory for the runs (default: a temporary one)")
    parser.add_argument("--no-resume", action="store_true", help="do not run the same command again after the fault")
    args = parser.parse_args()
    cases = [c for c in all_cases() if args.only in c.name]
    root = args.keep or Path(tempfile.mkdtemp(prefix="fault_matrix_"))
    server = S3Server().start() if any(c.fault == "store_stalled" for c in cases) else None
    store = Store(server) if server else None
    print(f"{'case':<38} {'exit s':>7} {'left':>5} {'code':>5} {'resumed':>9} {'same':>5}  problems", flush=True)
    bad = 0
    try:
        for case in cases:
            try:
                outcome = run_case(case, root / case.name, root / "cache", store=store, resume=not args.no_resume)
            except AssertionError as exc:  # the case never reached its fault (the run failed before step 3)
                bad += 1
                print(f"{case.name:<38} {'-':>7} {'-':>5} {'-':>5} {'-':>9} {'-':>5}  {str(exc).splitlines()[0]}",
                      flush=True)
                continue
            found = problems(outcome)
            bad += bool(found)
            seconds = "hang" if outcome.seconds == float("inf") else f"{outcome.seconds:.1f}"
            r = outcome.resumed
            resumed = f"{r.from_step}->{r.first_step}" if r else "-"
            print(f"{case.name:<38} {seconds:>7} {len(outcome.left):>5} {str(outcome.code):>5} {resumed:>9} "
                  f"{r.compared if r else '-':>5}  {'; '.join(found)}", flush=True)
    finally:
        if store:
            store.stop()
            server.stop()
    print(f"{len(cases) - bad}/{len(cases)} cases without problems (runs in {root})")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
