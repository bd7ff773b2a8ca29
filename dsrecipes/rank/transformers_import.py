"""Importing transformers without re-reading its whole `models/` tree twice in every process.

transformers 5.x builds its lazy import table by reading every file under `transformers/models/` (1,100 folders,
2,600 files) and parsing their `__all__` lists (`utils/import_utils.py::define_import_structure`). It does so twice
per process, under two cache keys: once in `transformers/__init__.py` (`define_import_structure(.../models,
prefix="models")`) and once more in `transformers/models/__init__.py` (`define_import_structure(__file__)`), whose
results differ only by that prefix. Measured on the 2-core test machine: 1.3 s of CPU per process, in every launching
process and every rank (about 250 processes in one test suite), for a table that changes only when transformers'
files do.

So the table of `transformers/models` is kept in one JSON file per transformers installation under
`$XDG_CACHE_HOME/dsrecipes/transformers/` (default `~/.cache`), stamped with transformers' version and the size and
modification time of every file in that tree; a stamp that does not match, or a file that does not parse into the
expected shape, is computed again by transformers' own function and rewritten (atomically). Both calls are served
from it, each with its own prefix, exactly as transformers would build them. JSON, not pickle: the file is data
that is checked, never code. Any other folder, a transformers without that function, or a cache that cannot be written
leaves transformers to do what it always does.

The hook has to sit between transformers loading `utils/import_utils.py` and calling it a few lines later, so
`install()` (run when `dsrecipes` is imported) puts a one-shot finder on `sys.meta_path` that wraps that one module's
loader, replaces `define_import_structure` right after the module executes, then gives the module its own loader
back. It does nothing when transformers is already imported.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import json
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set, Tuple

from dsrecipes.core.fileio import atomic_write_text
from dsrecipes.core.paths import user_cache_dir

TARGET = "transformers.utils.import_utils"
FORMAT = 1
STATS = {"hits": 0, "computed": 0, "read": 0}  # calls not computed / computed by transformers; files read (tests)
_LOADED: Dict[Path, List[Any]] = {}  # this process's table of each folder, as JSON rows

Structure = Dict[FrozenSet[str], Dict[str, Set[str]]]


def install() -> None:
    """Put the one-shot finder in front of the import system, once, unless transformers is loaded already."""
    if "transformers" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


def cache_dir() -> Path:
    return user_cache_dir() / "dsrecipes" / "transformers"


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Optional[ModuleType] = None) -> Any:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # one module, once: from here on the import system is as it was
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """The module's own loader; after it has executed the module, `define_import_structure` is replaced."""

    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: Any) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self._loader  # tracebacks and get_source see the real one
        self._loader.exec_module(module)
        original = getattr(module, "define_import_structure", None)
        if callable(original) and getattr(module, "__file__", None):
            module.define_import_structure = _cached(original, Path(module.__file__).resolve().parents[1] / "models")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def _cached(original: Callable[..., Structure], models_dir: Path) -> Callable[..., Structure]:
    def define_import_structure(module_path: Any, prefix: Optional[str] = None) -> Structure:
        folder = Path(module_path)
        folder = folder.parent if folder.is_file() else folder  # transformers reads a file's folder, too
        if folder.resolve() != models_dir:
            return original(module_path, prefix)
        table = load_or_build(models_dir, lambda: original(str(models_dir)))
        if prefix is None:
            return table
        return {backends: {f"{prefix}.{name}": objects for name, objects in modules.items()}
                for backends, modules in table.items()}

    define_import_structure.__wrapped__ = original
    return define_import_structure


def load_or_build(models_dir: Path, build: Callable[[], Structure]) -> Structure:
    """The table of `models_dir`: from this process's first answer, else from its cache file when the stamp matches,
    else `build()` (and the file rewritten). The tree is walked and the file read once per process; every call gets a
    fresh copy, because transformers updates the table it gets in place (transformers/__init__.py adds its names)."""
    rows = _LOADED.get(models_dir)
    if rows is not None:
        STATS["hits"] += 1
        return _from_json(rows)
    rows, table = _read_or_build(models_dir, build)
    _LOADED[models_dir] = rows
    return table


def _read_or_build(models_dir: Path, build: Callable[[], Structure]) -> Tuple[List[Any], Structure]:
    """(the table as JSON rows, kept for this process's later calls; the table itself, for this first call)."""
    path = cache_dir() / f"{hashlib.sha256(str(models_dir).encode()).hexdigest()[:24]}.json"
    stamp = tree_stamp(models_dir)
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(saved, dict) and saved.get("format") == FORMAT and saved.get("stamp") == stamp:
            rows = saved.get("table")
            table = _from_json(rows)  # checked for shape before it is kept
            STATS["hits"] += 1
            STATS["read"] += 1
            return rows, table
    except (OSError, ValueError, TypeError, AttributeError):
        pass  # missing, unreadable or not ours in shape: computed again below
    table = build()
    rows = _to_json(table)
    STATS["computed"] += 1
    try:
        atomic_write_text(path, json.dumps({"format": FORMAT, "stamp": stamp, "table": rows}))
    except OSError:
        pass  # a read-only home: transformers just computes it each time, as without this module
    return rows, table


def tree_stamp(folder: Path) -> str:
    """sha256 over transformers' version and (path, size, mtime) of every entry under `folder`."""
    digest = hashlib.sha256(str(getattr(sys.modules.get("transformers"), "__version__", "")).encode())
    pending = [str(folder)]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.name == "__pycache__":
                    continue
                if entry.is_dir(follow_symlinks=False):
                    pending.append(entry.path)
                info = entry.stat(follow_symlinks=False)
                digest.update(f"{entry.path}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _to_json(table: Structure) -> List[Any]:
    return [[sorted(backends), {name: sorted(objects) for name, objects in modules.items()}]
            for backends, modules in table.items()]


def _from_json(rows: Any) -> Structure:
    table: Structure = {}
    for backends, modules in rows:
        if not (isinstance(backends, list) and isinstance(modules, dict)):
            raise TypeError("not an import table")
        if not all(isinstance(b, str) for b in backends):
            raise TypeError("not an import table")
        entry = table.setdefault(frozenset(backends), {})
        for name, objects in modules.items():
            if not (isinstance(objects, list) and all(isinstance(o, str) for o in objects)):
                raise TypeError("not an import table")
            entry[name] = set(objects)
    return table
