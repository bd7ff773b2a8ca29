"""`launcher.extra_args`: a positive list of options per launcher, each with a typed value, confirmed by the
launcher's own argument parser.

A recipe may tune how a launcher starts the ranks (`--ssh_port`, `--bind_cores_to_rank`, `--max-restarts`,
`--bind-to core`); it may never change what program runs. So an argument is accepted only when it is an option of
ALLOWED[kind] spelled exactly (no abbreviations), followed by a value of its type (`--opt=value` or `--opt value`);
everything else, positional arguments included, is refused by name. Options dsrecipes sets itself (ports, node and
process counts, hostfiles) point to their typed `launcher.*` field. For DeepSpeed's runner and torchrun the complete
command line is then parsed by the launcher's own parser (`deepspeed.launcher.runner.parse_args`,
`torch.distributed.run.get_args_parser`), and the program it would start must still be dsrecipes' worker. mpirun
has no Python parser: its table is the whole check. `launcher=slurm` passes extra_args to the no-ssh DeepSpeed runner
inside each srun task, so it takes DeepSpeed's table; `launcher=local` starts no launcher and takes none.

A single-node `launcher=deepspeed` run, and each node of a `launcher=deepspeed_multinode` run without a hostfile,
starts DeepSpeed's per-node launcher (`deepspeed.launcher.launch`) itself, with the arguments DeepSpeed's runner
would give it (`deepspeed_node_args`); the runner, one more Python process that imports all of DeepSpeed only to
write that command line, is skipped. That command line is checked by
`deepspeed.launcher.launch`'s own parser the same way. It runs as `python -u -m dsrecipes.run.launch.ds_node` (NODE_ENTRY):
DeepSpeed's `launch.main()` itself, imported without the mlflow import DeepSpeed's autotuner makes (ds_node.py).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import re
import sys
from typing import Dict, List, Optional, Tuple

from dsrecipes.boundary.values import (
    CORE_LIST,
    FLAG,
    HOST,
    INT_LIST,
    NAME,
    PORT,
    Value,
    choice,
    integer,
    key_values,
    number,
    shape,
)
from dsrecipes.core.deepspeed_import import load_deepspeed
from dsrecipes.core.errors import ConfigError
from dsrecipes.core.schema import LauncherKind

KEY = "launcher.extra_args"
MAX_HOSTFILE = 1 << 20  # characters: far more than any cluster's host list
_HOSTFILE_WORD = re.compile(r"[A-Za-z_]{1,32}=\d{1,6}", re.ASCII)  # slots=8, max_slots=8
_LOG_LEVELS = choice("debug", "info", "warning", "error", "critical")
_STD_STREAMS = shape(r"[0-3]|\d{1,4}:[0-3](?:,\d{1,4}:[0-3])*", "0-3, or LOCAL_RANK:0-3 pairs such as 0:3,1:0")
_RDZV_KEYS = ("timeout", "join_timeout", "last_call_timeout", "close_timeout", "read_timeout")

# option spelling -> (the launcher parser's dest, value type). Spellings are the parsers' own, listed exactly.
FORCE_MULTI = "--force_multi"  # DeepSpeed's runner then goes through pdsh even to one host (builders._pdsh_words)
_DEEPSPEED: Dict[str, Tuple[str, Value]] = {
    "--ssh_port": ("ssh_port", PORT),
    "--bind_cores_to_rank": ("bind_cores_to_rank", FLAG),
    "--bind_core_list": ("bind_core_list", CORE_LIST),
    "--no_ssh_check": ("no_ssh_check", FLAG),
    FORCE_MULTI: ("force_multi", FLAG),
    "--log_level": ("log_level", _LOG_LEVELS),
    "--quiet": ("quiet", FLAG),
}
_TORCHRUN: Dict[str, Tuple[str, Value]] = {}
for _dest, _value in (("max_restarts", integer(0, 1000)), ("monitor_interval", number(0.0)),
                      ("start_method", choice("spawn", "fork", "forkserver")), ("redirects", _STD_STREAMS),
                      ("tee", _STD_STREAMS), ("local_ranks_filter", INT_LIST), ("local_addr", HOST),
                      ("rdzv_conf", key_values(_RDZV_KEYS, integer(1, 86400))),
                      ("numa_binding", choice("node", "socket", "exclusive", "core-complex")),
                      ("shutdown_timeout", integer(0, 86400)), ("virtual_local_rank", FLAG)):
    _TORCHRUN["--" + _dest.replace("_", "-")] = _TORCHRUN["--" + _dest] = (_dest, _value)
_TORCHRUN["--role"] = ("role", NAME)
_MPIRUN: Dict[str, Tuple[str, Value]] = {
    "--bind-to": ("bind-to", choice("none", "hwthread", "core", "l1cache", "l2cache", "l3cache", "socket", "numa",
                                    "package", "board")),
    "--map-by": ("map-by", shape(r"(?:ppr:\d{1,4}:)?(?:slot|hwthread|core|l1cache|l2cache|l3cache|socket|numa|"
                                 r"package|board|node)(?::(?:PE=\d{1,4}|SPAN|OVERSUBSCRIBE|NOOVERSUBSCRIBE))*",
                                 "an mpirun mapping such as core, socket:PE=4 or ppr:4:node")),
    "--rank-by": ("rank-by", choice("slot", "hwthread", "core", "socket", "numa", "package", "node")),
    "--report-bindings": ("report-bindings", FLAG),
    "--oversubscribe": ("oversubscribe", FLAG),
    "--tag-output": ("tag-output", FLAG),
    "--timestamp-output": ("timestamp-output", FLAG),
    "--display-map": ("display-map", FLAG),
    "--use-hwthread-cpus": ("use-hwthread-cpus", FLAG),
}
ALLOWED: Dict[LauncherKind, Dict[str, Tuple[str, Value]]] = {
    LauncherKind.local: {},
    LauncherKind.deepspeed: _DEEPSPEED,
    LauncherKind.deepspeed_multinode: _DEEPSPEED,
    LauncherKind.torchrun: _TORCHRUN,
    LauncherKind.mpirun: _MPIRUN,
    LauncherKind.slurm: _DEEPSPEED,
}
# DeepSpeed runner options its per-node launcher takes with the same spelling and meaning (the runner passes them on).
# --ssh_port, --no_ssh_check and --force_multi concern the runner's own ssh path: with them, the runner runs.
_NODE_LAUNCH = ("bind_cores_to_rank", "bind_core_list", "log_level", "quiet")
NODE_LAUNCHER = "deepspeed.launcher.launch"  # whose parser reads the per-node command line
NODE_ENTRY = "dsrecipes.run.launch.ds_node"  # what runs it: NODE_LAUNCHER's main(), DeepSpeed imported without mlflow
_NODE_PROGRAM = ("training_script", "training_script_args", "module", "no_python", "no_local_rank", "world_info",
                 "master_addr", "master_port", "node_rank", "save_pid", "enable_each_rank_log")
# Options dsrecipes sets from typed fields: giving them again would disagree with what the run uses.
OWN_FIELDS = {
    "--master_port": "launcher.master_port", "--master-port": "launcher.master_port",
    "--master_addr": "launcher.master_addr", "--master-addr": "launcher.master_addr",
    "--num_gpus": "launcher.num_gpus", "--num_accelerators": "launcher.num_gpus", "-np": "launcher.num_gpus",
    "--nproc_per_node": "launcher.num_gpus", "--nproc-per-node": "launcher.num_gpus", "-n": "launcher.num_gpus",
    "--num_nodes": "launcher.num_nodes", "--nnodes": "launcher.num_nodes",
    "--hostfile": "launcher.hostfile", "-H": "launcher.hostfile", "--include": "launcher.include",
    "-i": "launcher.include", "--exclude": "launcher.exclude", "-e": "launcher.exclude",
    "--node_rank": "launcher.node_rank", "--node-rank": "launcher.node_rank",
    "--rdzv_endpoint": "launcher.rdzv_endpoint", "--rdzv-endpoint": "launcher.rdzv_endpoint",
    "-x": "launcher.env", "--env": "launcher.env",
}


def extra_args_problems(kind: LauncherKind, args: List[str]) -> List[str]:
    """`launcher.extra_args[i]: ...` for every argument that is not an allowed option with a value of its type,
    then (when all are) the launcher's own parser's verdict."""
    problems, _ = _scan(kind, args)
    if not problems and args:
        problems = _parser_problems(kind, args)
    return problems


def checked_extra_args(kind: LauncherKind, args: List[str]) -> List[str]:
    """The arguments, after the checks of `extra_args_problems` (ConfigError when any fails): the only way
    `launcher.extra_args` reaches a command line."""

    problems = extra_args_problems(kind, list(args))
    if problems:
        raise ConfigError(problems)
    return list(args)


def _scan(kind: LauncherKind, args: List[str]) -> Tuple[List[str], List[str]]:
    """(problems, the parser dests the arguments set)."""
    table = ALLOWED[kind]
    problems: List[str] = []
    dests: List[str] = []
    i = 0
    while i < len(args):
        arg, where = str(args[i]), f"{KEY}[{i}]"
        name, eq, inline = arg.partition("=")
        i += 1
        if name not in table:
            first = not any("never accepted" in p or "takes no extra" in p for p in problems)
            problems.append(f"{where}: {_refusal(kind, arg, name, table) if first else _short(arg)}")
            continue
        dest, value = table[name]
        dests.append(dest)
        if value.flag:
            if eq:
                problems.append(f"{where}: {name} is a flag and takes no value, got {arg!r}")
            continue
        if not eq:
            if i >= len(args):
                problems.append(f"{where}: {name} needs a value ({value.expected})")
                continue
            inline, i = str(args[i]), i + 1
        wrong = value.check(inline)
        if wrong:
            problems.append(f"{where}: {name} needs {wrong}, got {inline!r}")
    return problems, dests


def _refusal(kind: LauncherKind, arg: str, name: str, table: Dict[str, Tuple[str, Value]]) -> str:
    if kind is LauncherKind.local:
        return f"{arg!r}: launcher=local starts no launcher program, so it takes no extra arguments"
    if name in OWN_FIELDS:
        return f"{name} is set by dsrecipes from {OWN_FIELDS[name]}; set that field instead"
    what = "a positional argument (it would name the program to run)" if not arg.startswith("-") else \
        "not an option dsrecipes passes to this launcher"
    first: Dict[str, str] = {}
    for spelling, (dest, _) in table.items():
        first.setdefault(dest, spelling)
    allowed = ", ".join(sorted(first.values()))
    return (f"{arg!r} is {what}; launcher={kind.value} accepts only {allowed} (each with a typed value). "
            "Options that choose the program (--no_python, --module, a script, --launcher_args, ...) are never "
            "accepted from a configuration")


def _short(arg: str) -> str:
    what = "a positional argument" if not arg.startswith("-") else "not an allowed option"
    return f"{arg!r} is {what} (see the first refused argument for what is accepted)"


def deepspeed_node_args(hosts: Dict[str, List[int]], master_port: int, extra_args: List[str], worker_module: str,
                        worker_args: List[str], master_addr: str = "127.0.0.1", node_rank: Optional[int] = None,
                        kind: LauncherKind = LauncherKind.deepspeed) -> Optional[List[str]]:
    """The arguments of `python -u -m deepspeed.launcher.launch` for the ranks of one node, as DeepSpeed's runner
    writes them (runner.py main: `--world_info` is base64 JSON of {host: slots} in the hostfile's order,
    {"localhost": slots} with master address 127.0.0.1 on this machine alone; `--node_rank=N` in --no_ssh mode; the
    allowed options passed on, `--log_level` always; the runner also spells out a default,
    `--enable_each_rank_log=None`), then the worker module and its arguments. None when `launcher.extra_args` holds
    an option that only the runner understands: then the runner runs."""
    extra = checked_extra_args(kind, extra_args)
    given = _values(kind, extra)
    if any(d not in _NODE_LAUNCH for d in given):
        return None
    layout = {str(host): [int(s) for s in slots] for host, slots in hosts.items()}
    world = base64.urlsafe_b64encode(json.dumps(layout).encode()).decode()
    head = [f"--world_info={world}", f"--master_addr={master_addr}", f"--master_port={int(master_port)}"]
    head += [] if node_rank is None else [f"--node_rank={int(node_rank)}"]
    head += ["--module", "--no_local_rank"]
    node = ["--bind_cores_to_rank"] if given.get("bind_cores_to_rank") else []
    node += [f"--bind_core_list={given['bind_core_list']}"] if "bind_core_list" in given else []
    node += ["--quiet"] if given.get("quiet") else []
    node += [f"--log_level={'error' if given.get('quiet') else given.get('log_level', 'info')}"]
    tail = [worker_module, *worker_args]
    if extra:  # the per-node launcher's own parser: these change only the allowed options
        dests = [*given, "log_level"]  # (--quiet means --log_level=error)
        problems = _changes(_deepspeed_node_parse, head, node, tail, dests, _NODE_PROGRAM,
                            "deepspeed per-node launcher")
        if problems:
            raise ConfigError(problems)
    return head + node + tail


def _values(kind: LauncherKind, args: List[str]) -> Dict[str, object]:
    """dest -> value (True for a flag) of arguments that passed `_scan`."""
    table, values, i = ALLOWED[kind], {}, 0
    while i < len(args):
        name, eq, inline = str(args[i]).partition("=")
        dest, value = table[name]
        i += 1
        if not value.flag and not eq:
            inline, i = str(args[i]), i + 1
        values[dest] = True if value.flag else inline
    return values


def _parser_problems(kind: LauncherKind, args: List[str]) -> List[str]:
    """Parse a complete command line with the launcher's own parser, with and without `args`: the program it starts
    must be the worker module either way, and only the dests of the allowed options may differ."""
    run = ["--run-dir", "/run"]
    if kind in (LauncherKind.deepspeed, LauncherKind.deepspeed_multinode, LauncherKind.slurm):
        head, tail = ["--master_port", "29500"], ["--no_local_rank", "--module", "dsrecipes.rank.worker", *run]
        program = ("user_script", "user_args", "module", "no_python", "launcher", "launcher_args", "venv_script")
        parse = _deepspeed_parse
    elif kind is LauncherKind.torchrun:
        head, tail = ["--nproc_per_node", "1", "--nnodes", "1"], ["-m", "dsrecipes.rank.worker", *run]
        program = ("training_script", "training_script_args", "module", "no_python", "run_path", "logs_specs")
        parse = _torchrun_parse
    else:
        return []
    _, dests = _scan(kind, args)
    return _changes(parse, head, list(args), tail, dests, program, f"{kind.value} launcher")


def _changes(parse, head: List[str], args: List[str], tail: List[str], dests: List[str], program, launcher: str):
    """Parse `head + tail` and `head + args + tail`: only the dests of the allowed options in `args` may differ."""
    base, given = parse(head + tail), parse(head + args + tail)
    if base is None or given is None:
        return [f"{KEY}: {' '.join(args)!r} is not understood by the {launcher}'s own argument parser"]
    changed = {k for k in set(vars(base)) | set(vars(given)) if getattr(base, k, None) != getattr(given, k, None)}
    wrong = sorted(k for k in changed if k in program or k not in dests)
    if wrong:
        return [f"{KEY}: {' '.join(args)!r} changes {', '.join(wrong)} of the {launcher} (the program it "
                "starts is always dsrecipes' worker)"]
    return []


def _quietly(call):
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            return call()
        except SystemExit:  # argparse's error()
            return None


def _deepspeed_parse(argv: List[str]):
    load_deepspeed()
    from deepspeed.launcher.runner import parse_args

    return _quietly(lambda: parse_args(argv))


def _deepspeed_node_parse(argv: List[str]):
    load_deepspeed()
    from deepspeed.launcher import launch  # its parse_args() reads sys.argv

    saved = sys.argv
    sys.argv = [NODE_LAUNCHER, *argv]
    try:
        return _quietly(launch.parse_args)
    finally:
        sys.argv = saved


def _torchrun_parse(argv: List[str]):
    from torch.distributed.run import get_args_parser

    return _quietly(lambda: get_args_parser().parse_args(argv))


def hostfile_problems(path: str) -> List[str]:
    """`launcher.hostfile`: its host names reach ssh/pdsh and mpirun's command lines, so each line must be a host
    name (HOST: never an option such as `-oProxyCommand=...`) followed by `key=value` words (`slots=8`). A message
    names the line and which word is wrong, never the file's text (it may be a token file named by mistake)."""

    try:
        with open(os.path.expanduser(path), encoding="utf-8") as fh:
            text = fh.read(MAX_HOSTFILE + 1)
        if len(text) > MAX_HOSTFILE:  # the launcher reads all of it: every line must have been checked
            return [f"launcher.hostfile: {path} is longer than {MAX_HOSTFILE} characters; a hostfile has lines "
                    "'HOST slots=N'"]
        lines = text.splitlines()
    except UnicodeDecodeError:
        return [f"launcher.hostfile: {path} is not UTF-8 text; a hostfile has lines 'HOST slots=N'"]
    except OSError as exc:
        return [f"launcher.hostfile: cannot read {path} ({exc.strerror or type(exc).__name__})"]
    problems = []
    for lineno, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        # the host as DeepSpeed's parser takes it: the line's first word, a '#' inside it included
        host, rest = line.split()[0].split(":", 1)[0], words[1:]
        bad = [i for i, w in enumerate(rest, 2) if not _HOSTFILE_WORD.fullmatch(w)]
        if HOST.check(host) or bad:
            which = "its first word is not a host name" if HOST.check(host) else f"word {bad[0]} is not key=value"
            problems.append(f"launcher.hostfile: {path}:{lineno}: needs 'HOST slots=N' ({HOST.expected}); {which} "
                            "(the line is not shown: the file may not be a hostfile)")
    return problems


