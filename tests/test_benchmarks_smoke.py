"""Every script in benchmarks/ runs in its `--smoke` mode: imports, paths, the functions it calls and its result file.

A renamed function, a moved module or a broken path then fails here, not in the next measurement. Each script is
found by listing benchmarks/ (helpers start with `_`), so a new benchmark without a working `--smoke` fails too.
Each runs as its own process (`python SCRIPT --smoke --out DIR`, with a timeout), as a user runs it; what it prints
as `NOTE:` (a substitution, a skipped phase, smoke sizes) must also be in its result file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsrecipes.core.paths import user_cache_dir
from tests.conftest import subprocess_env

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
SCRIPTS = sorted([p for p in BENCH.glob("*.py") if not p.name.startswith("_")] + sorted(BENCH.glob("start_trace/*.py")))
TIMEOUT_S = 420  # each smoke takes seconds to ~40 s on a quiet 2-core machine; the bound is for a loaded one


def result_file(script: Path, out: Path) -> Path:
    if script.name == "gpu_smoke.py":
        return out / "results.json"
    prefix = "start_trace_" if script.parent.name == "start_trace" else ""
    return out / f"{prefix}{script.stem}.json"


@pytest.fixture(scope="module")
def bytecode() -> dict:
    """What scripts/test.sh sets for the whole suite, also when this file runs on its own (`pytest tests/...`): where
    PYTHONDONTWRITEBYTECODE is set and torch ships without most of its bytecode, every smoke process (and each of its
    children, ~30) would compile the same ~900 torch modules again, ~2 CPU s each; the suite's bytecode cache
    instead. Unchanged where a PYTHONPYCACHEPREFIX is already set (scripts/test.sh) or torch has its bytecode."""
    probe = Path(importlib.util.find_spec("torch").origin).parent / "distributed" / "tensor" / "__init__.py"
    compiles = probe.is_file() and not Path(importlib.util.cache_from_source(str(probe))).is_file()
    if os.environ.get("PYTHONPYCACHEPREFIX") or not (compiles and os.environ.get("PYTHONDONTWRITEBYTECODE")):
        return {}
    return {"PYTHONPYCACHEPREFIX": str(user_cache_dir() / "dsrecipes" / "pycache"), "PYTHONDONTWRITEBYTECODE": None}


def run_smoke(script: Path, out: Path, extra: dict | None = None) -> subprocess.CompletedProcess:
    env = subprocess_env({"HF_HUB_OFFLINE": "1", "PYTHONPATH": None, **(extra or {})})  # the scripts find this checkout
    return subprocess.run([sys.executable, str(script), "--smoke", "--out", str(out)], cwd=out, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def test_every_benchmark_is_listed():
    names = {str(p.relative_to(BENCH)) for p in SCRIPTS}
    assert {"bench_store.py", "bench_runner.py", "bench_rank_start.py", "gpu_smoke.py", "start_trace/timeline.py",
            "start_trace/sitecustomize.py"} <= names, names


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(BENCH)))
def test_smoke(script: Path, tmp_path: Path, bytecode: dict):
    done = run_smoke(script, tmp_path, bytecode)
    tail = f"\n--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{script.name} --smoke exited {done.returncode}{tail}"
    assert "Traceback" not in done.stderr, tail
    path = result_file(script, tmp_path)
    assert path.is_file(), f"no result file {path}{tail}"
    result = json.loads(path.read_text())
    assert result["smoke"] is True and "error" not in result, result
    printed = [line[len("NOTE: "):] for line in done.stdout.splitlines() if line.startswith("NOTE: ")]
    missing = [note for note in printed if note not in result["notes"]]
    assert not missing, f"printed but not in {path.name}: {missing}"
    assert not list(tmp_path.rglob("*.tmp")), "a result file left half written"
    if script.name == "bench_store.py":
        check_store(tmp_path, result)
    if script.name == "gpu_compare.py":
        check_compare(tmp_path, done.stdout)


def check_store(out: Path, result: dict) -> None:
    """The corpus is generated (never a folder outside the checkout), every dsrecipes reader built its own client,
    and a missing mosaicml-streaming is said on the output and in the result, never silently skipped."""
    assert result["corpus"]["mb_asked"] == 0.25 and result["corpus"]["corpus_bytes"] >= 0.25 * (1 << 20)
    for row in (r for r in result["rows"] if r["system"] == "ds"):
        assert all(row[str(r)]["clients_built"] == r for r in (1, 2)), row
    readme = (out / "README.md").read_text()
    assert "What each system was given" in readme and "shared" not in readme
    streaming = importlib.util.find_spec("streaming") is not None
    skipped = [n for n in result["notes"] if "streaming side SKIPPED" in n]
    assert bool(skipped) != streaming, (streaming, result["notes"])
    assert {r["system"] for r in result["rows"]} == ({"ds", "st"} if streaming else {"ds"})


def check_compare(out: Path, stdout: str) -> None:
    """gpu_compare's CPU dry run ran every system (each exit 0, a number), wrote compare.json's rows, the plot and
    the ratio table, and started TRL as a user does: its SFTTrainer on the DeepSpeed JSON, best = packing +
    padding_free without gradient checkpointing, the same tokens per optimizer step as dsrecipes."""
    rows = json.loads((out / "compare.json").read_text())
    keys = ("system", "model", "params", "zero", "micro_batch", "seq_len", "tokens_per_s", "mfu", "peak_mem_gib",
            "settings")
    assert [r["system"] for r in rows] == ["dsrecipes", "dsrecipes_levers", "trl_best", "trl_plain", "bare"], rows
    assert all(list(r)[:len(keys)] == list(keys) and r["exit"] == 0 and r["tokens_per_s"] > 0 for r in rows), rows
    by = {r["system"]: r for r in rows}
    best, plain = by["trl_best"]["settings"], by["trl_plain"]["settings"]
    assert best["packing"] and best["padding_free"] and not best["gradient_checkpointing"], best
    assert "packing" not in plain and best["deepspeed"] == plain["deepspeed"] and best["deepspeed"], plain
    # real tokens on both TRL sides: a padding-free batch has no pad to leave out, a padded one has its mask
    assert best["include_num_input_tokens_seen"] == "all" and plain["include_num_input_tokens_seen"] == "non_padding"
    assert all(r.get("not_counted") is None and r["steps"] == 2 for r in rows), rows  # every run counted, all steps
    assert (best["per_device_train_batch_size"] * best["gradient_accumulation_steps"] ==
            by["dsrecipes"]["micro_batch"] * by["dsrecipes"]["grad_accum"])
    assert "data.packing=true" in by["dsrecipes_levers"]["settings"]["overrides"]
    assert (out / "compare.png").stat().st_size > 0
    assert "ds/trl_best" in stdout and any(line.startswith("tiny ") for line in stdout.splitlines())


def test_store_corpus_is_deterministic_and_of_the_asked_size(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        from _sharegpt_corpus import write_corpus
    finally:
        sys.path.remove(str(BENCH))
    a, b = write_corpus(tmp_path / "a", 0.2, 3), write_corpus(tmp_path / "b", 0.2, 3)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    sizes = [p.stat().st_size for p in a]
    assert sum(sizes) >= 0.2 * (1 << 20) and len(set(sizes)) == 3  # uneven files
    rows = [json.loads(line) for p in a for line in p.read_text(encoding="utf-8").splitlines()]
    assert len({r["id"] for r in rows}) == len(rows)
    assert all(r["conversations"][0]["from"] == "human" and r["conversations"][-1]["from"] == "gpt" for r in rows)


@pytest.mark.slow
def test_rank_start_second_environment_sees_a_virtual_environments_packages(tmp_path):
    """bench_rank_start's environment B, built while A is itself a virtual environment, sees A's own packages (a
    plain `venv --system-site-packages` from a venv sees only the base interpreter's: no torch there)."""
    a = tmp_path / "venv_a"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(a)], check=True)
    purelib = subprocess.run([str(a / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "only_in_venv_a.py").write_text("")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from bench_rank_start import environment_b; from pathlib "
            "import Path; print(environment_b(Path(sys.argv[2])))")
    made = subprocess.run([str(a / "bin" / "python"), "-c", code, str(BENCH), str(tmp_path / "venv_b")],
                          capture_output=True, text=True, env=subprocess_env({"PYTHONPATH": None}), timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    b = made.stdout.strip().splitlines()[-1]
    probe = "import importlib.util as u, sys; print(sys.prefix, bool(u.find_spec('only_in_venv_a')))"
    seen = subprocess.run([b, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert seen == [str(tmp_path / "venv_b"), "True"], seen


def test_gpu_compare_ratios_take_the_default_recipe_against_trl_at_its_fastest(monkeypatch):
    """The table's dsrecipes/TRL ratios use dsrecipes' default recipe (never the faster of it and the levers) over
    TRL at its best (the faster of trl_best on sdpa and trl_best_flex), and a GPU without flash-attn runs both TRL
    variants by default: a harness that picked TRL's slow attention path would flatter dsrecipes."""
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_compare
    finally:
        sys.path.remove(str(BENCH))
    cell = {"model": "m", "zero": 2}
    rows = [{**cell, "system": s, "tokens_per_s": v} for s, v in
            (("dsrecipes", 100.0), ("dsrecipes_levers", 300.0), ("trl_best", 50.0), ("trl_best_flex", 200.0),
             ("trl_plain", 80.0), ("bare", 400.0))]
    line = gpu_compare.ratio_table(rows).splitlines()[1].split()
    assert line[-3:] == ["0.50", "1.25", "1.50"], line  # 100/200, 100/80, 300/200
    monkeypatch.setattr(gpu_compare, "_cuda", lambda: True)
    monkeypatch.setattr(gpu_compare.importlib.util, "find_spec", lambda name: None)
    assert "trl_best_flex" in gpu_compare.parse_args([]).systems.split(",")
    monkeypatch.setattr(gpu_compare, "_cuda", lambda: False)
    assert "trl_best_flex" not in gpu_compare.parse_args([]).systems.split(",")
