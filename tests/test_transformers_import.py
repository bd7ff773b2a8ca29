"""Importing dsrecipes patches nothing (issue 42 item 6): no finder or loader put in front of the import system, no
function of another library replaced. transformers is imported as it is, whether dsrecipes came first or not.

(dsrecipes once put a one-shot finder on sys.meta_path when imported, to serve transformers'
`define_import_structure` from a cache file: about 0.7 CPU s per process on the 2-core test machine. It is gone;
the cost is transformers' own.)"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import subprocess_env

# A fresh interpreter, as every launching process and rank starts. It records the import system and the global
# import state before and after importing the package and its command line, then imports transformers and checks that its table builder is transformers' own function.
SCRIPT = """
import json, sys
def state():
    return {"meta_path": [repr(type(f)) for f in sys.meta_path], "path_hooks": [repr(h) for h in sys.path_hooks],
            "import": repr(__builtins__.__import__ if hasattr(__builtins__, "__import__") else __import__),
            "foreign": sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "torch", "deepspeed"))}
before = state()
import dsrecipes
package = state()
import dsrecipes.cli
after = state()
import transformers.models
from transformers.utils import import_utils
define = import_utils.define_import_structure
print(json.dumps({"before": before, "package": package, "after": after, "define_module": getattr(define, "__module__", None),
                  "wrapped": hasattr(define, "__wrapped__") and define.__wrapped__.__module__ != define.__module__,
                  "finders": [type(f).__module__ for f in sys.meta_path]}))
"""


def test_importing_dsrecipes_leaves_the_import_system_and_transformers_as_they_are():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env=subprocess_env())
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    before, package, after = seen["before"], seen["package"], seen["after"]
    assert after["meta_path"] == before["meta_path"] and after["path_hooks"] == before["path_hooks"]
    assert after["import"] == before["import"]
    assert package == before and package["foreign"] == []  # importing the package loads none of those libraries
    assert seen["define_module"] == "transformers.utils.import_utils" and not seen["wrapped"]
    assert not any(m.startswith("dsrecipes") for m in seen["finders"]), seen["finders"]
