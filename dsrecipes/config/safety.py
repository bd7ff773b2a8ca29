"""No code from configuration: what a composition may hold that Hydra or Python's logging would execute.

Hydra instantiates every `_target_` under `hydra.callbacks` (and its launcher and sweeper), hands
`hydra.job_logging` / `hydra.hydra_logging` to `logging.config` (handler classes, `()` factories, files opened for
writing), exports `hydra.job.env_set` before a job and reads extra config directories from `hydra.searchpath`. The
only such entries a dsrecipes composition may hold are the ones conf/train.yaml and Hydra's own config files put
there: the sweep callback (`dsrecipes.observe.sweep.SweepSummary`), Hydra's basic launcher and sweeper, and no logging. So,
before anything is instantiated and before Hydra configures logging (`check`):
  * a command-line override may touch `hydra` only at ALLOWED_HYDRA_KEYS (run and sweep directories, verbosity):
    never a `hydra/...` group, an `@hydra` package, callbacks, logging, launcher, sweeper, search path or env;
  * the composed `hydra` node must equal the one conf/train.yaml alone composes (the baseline), apart from those
    keys and the fields Hydra fills in for each composition (RUNTIME_KEYS);
  * no `_target_` or `()` key anywhere that the baseline does not hold at the same place with the same value;
  * the SLURM environment to activate (COMMAND_LINE_ONLY: a venv's activate script, a conda env, modulefiles) is
    set only on the command line, never by a recipe or group file;
  * a field that reaches outside the run directory or the machine (config/field_classes.py: tracking URI, cache and
    NVMe directories, hostfile, rendezvous hosts; a run directory outside the working one) takes a shared recipe's
    value never: only the command line, the environment or the config tree name those (`outside_problems`);
  * `hydra.overrides` is what Hydra wrote there: exactly the command line's overrides (a recipe setting it would
    put its own overrides, even `--trust-checkpoint`, into the "train further" command a run prints);
Interpolations are not checked here (no scan of text): config/resolvers.py registers only RESOLVERS with OmegaConf,
and its `oc.env` reads only READABLE_ENV, so every form a recipe can write is refused where it resolves (a recipe is
data from someone else: `${oc.env:AWS_SECRET_ACCESS_KEY}` would copy a secret into config.yaml, a tracker or a path).
A refusal (ConfigError, exit 2) names where the key came from: the file (recipe or group file) found through Hydra's
defaults list, or the command-line override. This module is the rule, on plain data; config/hydra_app.py applies it
to every composition (a sweep's jobs through its guarded loader) and supplies the baseline and the sources.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from dsrecipes.boundary.batch_script import USER_NAMED_DIRECTIVES
from dsrecipes.config.field_classes import FIELDS, FieldClass, inside_working_dir, of
from dsrecipes.core.errors import ConfigError
from dsrecipes.data.sources.registry import load_registry
from dsrecipes.data.sources.remote import looks_like_url

ALLOWED_HYDRA_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "hydra.verbose")  # not sweep.subdir: jobs stay inside
RUNTIME_KEYS = ("runtime", "overrides", "mode", "job.override_dirname", "job.id", "job.num", "job.name",
                "job.config_name")
CODE_KEYS = ("_target_", "()")  # Hydra's instantiate, logging.config's factories
# Settings that choose code the batch job runs (boundary/batch_script.py): only the command line may set them.
COMMAND_LINE_ONLY = tuple(of(FieldClass.command_line))  # launcher.slurm_venv, slurm_conda_env, slurm_modules
RESOLVERS = ("dsr.asset", "now", "oc.env", "oc.select")  # the only ones registered (config/resolvers.py)
READABLE_ENV = ("DSRECIPES_SMOLLM2_DIR",)  # conf/model/smollm2_135m.yaml: where the SmolLM2 download lives
Path = Tuple[Any, ...]
MISSING = object()  # lookup(): no such key


def check(overrides: Sequence[str], composed: Any, baseline: Dict[str, Any], source_of: Callable[[Path, Any], str],
          shared_source: Callable[[Path, Any], Optional[str]] = lambda path, value: None) -> None:
    """ConfigError naming every key of `composed` (a composition with its `hydra` node) that would run code, or that
    a shared recipe set to reach outside the run directory; `baseline` is conf/train.yaml composed alone,
    `source_of(path, value)` names the file or override that set a key, `shared_source(path, value)` the shared
    recipe that set it (None: the command line or the config tree). config/hydra_app.py supplies them from Hydra."""
    problems = override_problems(overrides)
    if not problems:
        data = container(composed)
        for path, what in composition_problems(composed, baseline, overrides):
            source = source_of(path, lookup(data, path))
            problems.append(f"{_dotted(path)}: {what}, set by {source}; recipes, group files and overrides are data: "
                            "they cannot name code or change Hydra's callbacks, logging, launcher or environment")
        for path in COMMAND_LINE_ONLY:
            value = lookup(data, path)
            source = source_of(path, value) if value != lookup(baseline, path) else ""
            if source and not source.startswith("command-line override"):
                problems.append(f"{_dotted(path)}: set by {source}; it chooses code the batch job runs (an activate "
                                "script, modulefiles), so it is this machine's setting, not a recipe's: give it on "
                                "the command line")
        problems += outside_problems(data, baseline, shared_source, lambda path: resolved(composed, path))
    if problems:
        raise ConfigError(problems)


def outside_problems(data: Any, baseline: Dict[str, Any], shared_source: Callable[[Path, Any], Optional[str]],
                     resolve: Callable[[Path], Any] = lambda path: MISSING) -> List[str]:
    """A shared recipe's value for a field that reaches outside the run directory or the machine
    (config/field_classes.py: user-named only; the run directory only as a relative path inside the working one,
    judged on what it resolves to - `${trainer.experiment}` or `${now:/abs}` is relative text naming an absolute
    place; `resolve(path)`: the resolved value, MISSING where it cannot resolve, which refuses it where it resolves).
    Nothing was opened, read or sent for it yet: this runs on the composition, before any use."""
    problems = []
    for path in of(FieldClass.user_named) + of(FieldClass.run_dir):
        value = lookup(data, path)
        if value is MISSING or value == lookup(baseline, path):
            continue
        if FIELDS[_dotted(path)] is FieldClass.run_dir and inside_working_dir(value) and \
                inside_working_dir(resolve(path)):  # always as it resolves: text is not what is used
            continue
        source = shared_source(path, value)
        if source is None:
            continue
        where = "outside the working directory" if FIELDS[_dotted(path)] is FieldClass.run_dir else \
            "outside the run directory or this machine"
        problems.append(f"{_dotted(path)}: set by {source}, a shared recipe; it names a place {where} (a recipe "
                        f"could send your credentials to its host, or read or write your files), so only your "
                        f"command line or environment may name it: give {_dotted(path)}=... on the command line")
    return problems + _option_problems(data, baseline, shared_source, resolve) + \
        _store_problems(data, baseline, shared_source, resolve)


# Options inside allow-listed lists that name a host outside this machine: the user's own, like the user-named fields
# (a shared recipe's value is refused). Slurm mails the job's events to --mail-user; torchrun's --local_addr is the
# address the other nodes' ranks connect to when this node hosts the rendezvous (as launcher.master_addr).
OUTSIDE_OPTIONS = {("launcher", "slurm_sbatch_args"): tuple(f"--{k}" for k in USER_NAMED_DIRECTIVES),
                   ("launcher", "extra_args"): ("--local_addr", "--local-addr")}


def outside_option_places(path: Tuple[str, str], args: Sequence[Any]) -> List[int]:
    """The places in the list at `path` (resolved) holding an OUTSIDE_OPTIONS option, `--opt=value` or `--opt`."""
    return [i for i, arg in enumerate(args) if str(arg).partition("=")[0] in OUTSIDE_OPTIONS[path]]


def _option_problems(data: Any, baseline: Dict[str, Any], shared_source: Callable[[Path, Any], Optional[str]],
                     resolve: Callable[[Path], Any] = lambda path: MISSING) -> List[str]:
    """An OUTSIDE_OPTIONS option (`--opt=value` or `--opt value`) in a list that a shared recipe set, judged on the
    elements as they resolve (`"${oc.select:x,'--local_addr=HOST'}"` or `"${trainer.experiment}"` is text naming no
    option that resolves to one), and on their text where the list does not resolve (refused where it resolves)."""
    problems = []
    for path, options in OUTSIDE_OPTIONS.items():
        value = lookup(data, path)
        if not isinstance(value, list) or value == lookup(baseline, path):
            continue
        given = resolve(path)
        args = [str(a) for a in (given if isinstance(given, list) else value)]
        named = outside_option_places(path, args)
        source = shared_source(path, value) if named else None
        problems += [f"{_dotted(path)}[{i}]: {args[i].partition('=')[0]} set by {source}, a shared recipe; it names "
                     "a host outside this machine, so only your command line may name it: give "
                     f"{_dotted(path)}=[...] on the command line" for i in named] if source else []
    return problems


# Fields that may name objects in a store (data/sources/remote.py): reading one signs every request with the user's
# AWS credentials, and the bucket's owner sees the access key id in its logs. A shared recipe's bucket is read only
# when the user allowed it by name (SIGNED_BUCKETS_ENV) - or named it on the command line.
STORE_FIELDS = (("dataset", "paths"), ("dataset", "val_paths"), ("dataset", "sources"), ("dataset", "registry"),
                ("data", "shard_dir"))
SIGNED_BUCKETS_ENV = "DSRECIPES_S3_BUCKETS"  # comma- or space-separated bucket names


def allowed_buckets() -> List[str]:
    return os.environ.get(SIGNED_BUCKETS_ENV, "").replace(",", " ").split()


def foreign_buckets(value: Any) -> List[str]:
    """The buckets of the s3:// URLs in `value` (a resolved field: text, a list, a source's `paths`) that are not in
    SIGNED_BUCKETS_ENV, in order, each once."""
    if isinstance(value, dict):  # an entry of dataset.sources
        found = foreign_buckets(value.get("paths"))
    elif isinstance(value, list):
        found = [b for v in value for b in foreign_buckets(v)]
    else:
        found = [value[5:].split("/", 1)[0]] if isinstance(value, str) and value.startswith("s3://") else []
    return [b for i, b in enumerate(found) if b not in found[:i] and b not in allowed_buckets()]


def _store_problems(data: Any, baseline: Dict[str, Any], shared_source: Callable[[Path, Any], Optional[str]],
                    resolve: Callable[[Path], Any]) -> List[str]:
    """A shared recipe's s3:// URL of a bucket the user did not allow, judged as it resolves (its text where it
    does not resolve)."""
    problems = []
    for path in STORE_FIELDS:
        value = lookup(data, path)
        if value is MISSING or value == lookup(baseline, path):
            continue
        given = resolve(path)
        buckets = foreign_buckets(value if given is MISSING else given)
        source = shared_source(path, value) if buckets else None
        if source:
            problems.append(f"{_dotted(path)}: s3://{buckets[0]}/... set by {source}, a shared recipe; reading it would "
                            f"sign requests to that bucket with your AWS credentials (its owner's logs see your "
                            f"access key id), so only your command line may name it: give {_dotted(path)}=... on "
                            f"the command line, or allow the bucket: {SIGNED_BUCKETS_ENV}={','.join(buckets)}")
    registry = lookup(data, ("dataset", "registry"))
    if registry is MISSING or registry == lookup(baseline, ("dataset", "registry")):
        return problems
    given, use = resolve(("dataset", "registry")), resolve(("dataset", "use"))
    given = registry if given is MISSING else given
    entries = registry_buckets(given, lookup(data, ("dataset", "use")) if use is MISSING else use)
    source = shared_source(("dataset", "registry"), registry) if entries else None
    problems += [f"dataset.registry: entry {name!r} reads s3://{buckets[0]}/... (registry {given}, set by {source}, "
                 "a shared recipe); reading it would sign requests to that bucket with your AWS credentials (its "
                 "owner's logs see your access key id), so only your command line may name such a registry: give "
                 f"dataset.registry=... on the command line, or allow the bucket: {SIGNED_BUCKETS_ENV}="
                 f"{','.join(buckets)}" for name, buckets in entries] if source else []
    return problems


def registry_buckets(registry: Any, use: Any) -> List[Tuple[str, List[str]]]:
    """The entries of the registry file `registry` that `use` names, each with the buckets of its s3:// objects
    that are not in SIGNED_BUCKETS_ENV (only those entries); none where the registry is no local file or cannot be
    read as one (config/validate.py and the reader name why; an s3:// registry is a STORE_FIELDS bucket itself)."""
    if not isinstance(registry, str) or not registry or looks_like_url(registry) or not isinstance(use, list):
        return []
    try:
        entries = load_registry(registry, use=[str(name) for name in use], checked=True)
    except ConfigError:
        return []
    return [(name, buckets) for name, src in entries.items() if (buckets := foreign_buckets(src.paths))]


def override_problems(overrides: Sequence[str]) -> List[str]:
    """Command-line overrides that reach into Hydra's own configuration beyond ALLOWED_HYDRA_KEYS."""
    problems = []
    for ov in OverridesParser.create().parse_overrides(list(overrides)):
        key, package = ov.key_or_group, ov.package or ""
        touches = key == "hydra" or key.startswith(("hydra.", "hydra/")) or package.split(".")[0] == "hydra"
        if touches and not (key in ALLOWED_HYDRA_KEYS and not package and not ov.is_delete()):
            problems.append(f"command-line override '{ov.input_line}': Hydra's own settings are closed to the command "
                            f"line except {', '.join(ALLOWED_HYDRA_KEYS)} (callbacks, logging, launcher, sweeper, "
                            "search path and environment would run or load code)")
    return problems


def composition_problems(composed: Any, base: Dict[str, Any], overrides: Sequence[str] = ()) -> List[Tuple[Path, str]]:
    """(key path, what is wrong) for each code key, overrides recorded in `hydra.overrides` that are not
    `overrides`, and each change to the `hydra` node the baseline lacks."""
    data = container(composed)
    found: List[Tuple[Path, str]] = []
    for path, value in _code_keys(data):
        if lookup(base, path) != value:
            found.append((path, f"names code to run ({value!r})"))
    recorded = lookup(data, ("hydra", "overrides"))
    if recorded is not MISSING and _recorded_overrides(recorded) != sorted(overrides):
        found.append((("hydra", "overrides"), "changes the overrides Hydra records from the command line"))
    for path in _differences(data.get("hydra"), base.get("hydra"), ("hydra",)):
        if _allowed(path) or any(related(path[:2], p[:2]) for p, _ in found):
            continue  # one problem per part of the hydra node (callbacks, job_logging, job, ...)
        found.append((path, "changes Hydra's own configuration"))
    return found


def _recorded_overrides(recorded: Any) -> Any:
    """`hydra.overrides` ({task: [...], hydra: [...]}, as Hydra writes it) as one sorted list, else None."""
    if not isinstance(recorded, dict) or set(recorded) != {"task", "hydra"}:
        return None
    lists = [recorded["task"], recorded["hydra"]]
    if not all(isinstance(x, list) and all(isinstance(o, str) for o in x) for x in lists):
        return None
    return sorted(lists[0] + lists[1])


# ---------------------------------------------------------------------------------------------------------------
# The baseline and the comparison


def container(cfg: Any) -> Any:
    return OmegaConf.to_container(cfg, resolve=False) if OmegaConf.is_config(cfg) else cfg


def _code_keys(value: Any, path: Path = ()) -> Iterator[Tuple[Path, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            if k in CODE_KEYS:
                yield path + (k,), v
            yield from _code_keys(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _code_keys(v, path + (i,))


def _differences(a: Any, b: Any, path: Path) -> Iterator[Path]:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if k not in a or k not in b:
                yield path + (k,)
            else:
                yield from _differences(a[k], b[k], path + (k,))
    elif a != b:
        yield path


def _allowed(path: Path) -> bool:
    return _under(path, ALLOWED_HYDRA_KEYS) or _runtime(path)


def _runtime(path: Path) -> bool:
    """A field Hydra fills in for each composition (RUNTIME_KEYS)."""
    return _under(path, tuple(f"hydra.{k}" for k in RUNTIME_KEYS))


def _under(path: Path, keys: Sequence[str]) -> bool:
    dotted = _dotted(path)
    return any(dotted == k or dotted.startswith(k + ".") for k in keys)


def related(a: Path, b: Path) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def resolved(composed: Any, path: Path) -> Any:
    """The value at `path` with its interpolations resolved (through the allowed resolvers only), else MISSING."""
    if not OmegaConf.is_config(composed):
        return lookup(composed, path)
    try:
        value = OmegaConf.select(composed, _dotted(path), default=MISSING)
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    except Exception:  # noqa: BLE001 - refused where it resolves, with that message
        return MISSING


def lookup(value: Any, path: Path) -> Any:
    for k in path:
        if isinstance(value, dict) and k in value:
            value = value[k]
        elif isinstance(value, list) and isinstance(k, int) and 0 <= k < len(value):
            value = value[k]
        else:
            return MISSING
    return value


def _dotted(path: Path) -> str:
    return ".".join(f"[{k}]" if isinstance(k, int) else str(k) for k in path).replace(".[", "[")
