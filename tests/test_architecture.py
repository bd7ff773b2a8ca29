"""Layers point one way: the import graph of the package (module-level and lazy imports alike) has no cycle, domain
modules never import the command line, and a package's children never import their parent package."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dsrecipes"


def _modules() -> Dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _resolve(name: str) -> str:
    while name and name not in MODULES:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name


def _imports(module: str) -> Set[str]:
    out: Set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text(encoding="utf-8"))):
        names: List[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.startswith("dsrecipes") and (name in MODULES or name == _resolve(name) or "." not in name):
                target = _resolve(name)
                if target and target != module:
                    out.add(target)
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def test_the_graph_is_not_empty():
    assert len(GRAPH) > 40 and "dsrecipes.rank.train" in GRAPH["dsrecipes.rank.worker"]


def test_no_import_cycle():
    seen: Dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: List[str]) -> None:
        seen[module] = 1
        for target in sorted(GRAPH[module]):
            if seen.get(target) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in seen:
                visit(target, path + [target])
        seen[module] = 2

    for module in sorted(GRAPH):
        if module not in seen:
            visit(module, [module])


def test_only_the_command_line_imports_the_commands():
    for module, targets in GRAPH.items():
        if module in ("dsrecipes.cli", "dsrecipes.__main__") or module.startswith("dsrecipes.commands"):
            continue
        bad = sorted(t for t in targets if t == "dsrecipes.cli" or t.startswith("dsrecipes.commands"))
        assert not bad, f"{module} (a domain module) imports {bad}"


def test_every_subcommand_main_lives_in_commands():
    for module, path in MODULES.items():
        defines_main = any(isinstance(n, ast.FunctionDef) and n.name == "main"
                           for n in ast.parse(path.read_text(encoding="utf-8")).body)
        if defines_main:
            entry_points = ("dsrecipes.cli", "dsrecipes.rank.worker", "dsrecipes.run.launch.mpi_rank", "dsrecipes.run.launch.ds_node",
                            "dsrecipes.run.requeue", "dsrecipes.rank.batch_probe")
            assert module.startswith("dsrecipes.commands.") or module in entry_points, module


@pytest.mark.parametrize("package", sorted(m for m, p in MODULES.items() if p.name == "__init__.py"))
def test_children_never_import_their_parent_package(package):
    children = [m for m in MODULES if m.startswith(package + ".") and m.count(".") == package.count(".") + 1]
    for child in children:
        assert package not in GRAPH[child], f"{child} imports its parent package {package}"


def test_every_module_says_what_it_owns():
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert ast.get_docstring(tree), f"{module} has no opening comment"


def _imported_names(path: Path) -> List[str]:
    names: List[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def test_only_the_hydra_app_touches_hydras_internals():
    touching = sorted(m for m, p in MODULES.items() if any(n.startswith("hydra._internal") for n in _imported_names(p)))
    assert touching == ["dsrecipes.config.hydra_app"]


def test_the_architecture_doc_is_self_contained():
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    outside = [w for w in doc.split() if w.strip("`(),.;:").startswith(("../", "/work", "~/")) or "DESIGN.md" in w]
    assert not outside and "How we write code here" in doc, outside


def _unit(module: str) -> str:
    """The top-level folder (or top-level module) a module belongs to: dsrecipes.data.stream.index -> data."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _data_unit(module: str) -> str:
    """The sub-folder of `data/` a module belongs to: dsrecipes.data.plan.epoch -> plan ('' outside data/)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "data" else ""


@pytest.mark.parametrize("unit", [_unit, _data_unit], ids=["top-level folders", "folders inside data"])
def test_no_folder_level_import_tie(unit):
    """Folders (and top-level modules) point one way too: if anything in A imports B, nothing in B imports A. The
    graph counts imports inside functions, so a lazy import cannot hide a tie. Inside `data/` the flows (sources,
    render, stream, plan, prepare, shard, strategies) obey the same rule."""
    edges: Dict[str, Dict[str, str]] = {}
    for module, targets in GRAPH.items():
        for target in targets:
            a, b = unit(module), unit(target)
            if a and b and a != b:
                edges.setdefault(a, {}).setdefault(b, f"{module} -> {target}")
    ties = sorted(f"{a} <-> {b} ({edges[a][b]}; {edges[b][a]})"
                  for a in edges for b in edges[a] if a < b and a in edges.get(b, {}))
    assert not ties, "folder-level import ties:\n" + "\n".join(ties)


# Imports that stay inside functions, because importing them costs start-up time that commands which do not need
# them (`ls`, `validate`, `show`, `--help`) should not pay. Seconds: `python -c "import X"` timed with perf_counter,
# median of 3, on the shared 2-core machine while other jobs ran (load average ~2.5), so quiet-machine numbers are
# lower. huggingface_hub loads lazily itself: its number is `from huggingface_hub import HfApi`; trl's is a bare import.
# `python -X importtime -m dsrecipes ls` shows none of them. Our own modules that would pull one of these in say so
# next to the import: `# lazy: else `<module>` imports torch 3.80 s`.
LAZY = {
    "torch": 3.80, "deepspeed": 8.86, "transformers": 0.69, "datasets": 0.82, "peft": 4.23, "matplotlib": 0.22,
    "mlflow": 1.33, "wandb": 0.51, "hydra": 0.12, "huggingface_hub": 0.27, "pyarrow": 0.14, "tqdm": 0.03,
    "s3fs": 0.27, "fsspec": 0.07, "trl": 0.17, "moto": 0.27, "jinja2": 0.03,
}


def _local_imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom) and node.module:
                    yield node.lineno, node.module
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        yield node.lineno, alias.name


def test_imports_are_at_module_top_unless_measured():
    """Our own modules and the standard library are imported at module top, so the import graph is visible where a
    reader looks; only the heavy third-party packages above (their cost measured) are imported where they are used."""
    bad = []
    for module, path in MODULES.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for lineno, name in _local_imports(path):
            if name.split(".")[0] in LAZY or "# lazy:" in lines[lineno - 1]:
                continue
            bad.append(f"{path.relative_to(PACKAGE.parent)}:{lineno}: {name}")
    assert not bad, "imports inside functions (move them to the top, or say why with '# lazy: <reason>'):\n" + "\n".join(bad)


# ---------------------------------------------------------------------------------------------------------------
# Two wings over one floor (docs/architecture.md): the layout is the import rule.

LAUNCHING_SIDE = ("dsrecipes.cli", "dsrecipes.core", "dsrecipes.config", "dsrecipes.commands", "dsrecipes.run",
                  "dsrecipes.boundary", "dsrecipes.observe")
HEAVY = ("torch", "deepspeed", "transformers.modeling_utils")


def test_few_loose_modules_at_the_top():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert 0 < len(loose) <= 8, loose
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert {"core", "run", "rank", "boundary", "serve", "observe", "config", "commands", "data"} <= folders


def _in(module: str, folder: str) -> bool:
    return module == f"dsrecipes.{folder}" or module.startswith(f"dsrecipes.{folder}.")


@pytest.mark.parametrize("wing, other", [("run", "rank"), ("rank", "run")])
def test_the_two_wings_never_import_each_other(wing, other):
    """The launching wing (run/) and the rank wing (rank/) meet only on the floor below them; lazy imports count."""
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if _in(m, wing) for t in ts if _in(t, other))
    assert not bad, bad


def test_the_floor_stands_on_nothing():
    """core/ imports no other folder of the package: everything else may stand on it."""
    bad = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() if _in(m, "core") for t in ts if not _in(t, "core"))
    assert not bad, bad


def test_the_launching_side_loads_no_torch():
    """Every module of the launching side, imported in a fresh process, loads no torch, deepspeed or transformers'
    model code: the `validate`, `ls`, `show`, `--help` and launching paths never pay for them."""
    import subprocess
    import sys

    names = sorted(m for m in MODULES if any(_in(m, f.split(".", 1)[1]) for f in LAUNCHING_SIDE))
    assert len(names) > 60, names
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            f"    loaded = [h for h in {HEAVY!r} if h in sys.modules]\n"
            "    if loaded:\n"
            "        sys.exit(f'{name} loads {loaded}')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# Sizes a reader can hold (docs/architecture.md "How we write code here"): modules around 300 lines, never over 400;
# functions never over 60 lines.

MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60


def test_no_module_over_400_lines():
    long = sorted((len(p.read_text(encoding="utf-8").splitlines()), m) for m, p in MODULES.items())
    assert [x for x in long if x[0] > MAX_MODULE_LINES] == []


def test_no_function_over_60_lines():
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert long == []
