"""`launcher.env`: the variables a recipe may export to every rank, a positive table of documented names with typed
values (README "Trust model" shows it).

Only tuning knobs: thread counts, network interfaces, collective algorithms, allocator settings, offline switches.
Never a name whose value is a path the process loads or writes (plugins, libraries, caches, `TORCH_LOGS_OUT`,
`NCCL_DEBUG_FILE`, `TORCH_TRACE`, dump files, debug directories, `HF_HOME`). dsrecipes reads no test hook from the
environment (the tests inject their faults from tests/faults.py). A variable outside the table is the user's to
export in their own shell.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Tuple

from dsrecipes.boundary.values import BOOL01, INTERFACES, NAME, TRUE_FALSE, Value, choice, integer, key_values, shape
from dsrecipes.core.errors import ConfigError

KEY = "launcher.env"
# tests/test_trust_boundary.py checks that every DSRECIPES_* name the package reads from the environment is listed here.
LAUNCHING_SIDE = ("DSRECIPES_HOME", "DSRECIPES_RECIPES", "DSRECIPES_PROGRESS", "DSRECIPES_SMOLLM2_DIR",
                  "DSRECIPES_REQUIRE_SMOLLM2", "DSRECIPES_KEY_FILE",  # the key: the user's, never a recipe's (trust.py)
                  "DSRECIPES_S3_BUCKETS",  # buckets a shared recipe may name: the user's, never a recipe's (safety.py)
                  "DSRECIPES_TRACEBACK",  # =1: a crash of the launching process shows its traceback (cli.console_main)
                  "DSRECIPES_LAUNCH",  # the launching process's mark on what its launcher starts (run/launch/tree.py)
                  "DSRECIPES_NODE_LOCK")  # `dsrecipes node`'s lock, named to the ranks it starts (core/runplan.py)

_THREADS = integer(1, 4096)
_NCCL_ALGOS = ("Ring", "Tree", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
_ALLOC_KEYS = ("max_split_size_mb", "roundup_power2_divisions", "garbage_collection_threshold",
               "expandable_segments", "backend", "pinned_use_cuda_host_register", "pinned_num_register_threads")
_ALLOC_VALUE = shape(r"\d{1,9}(?:\.\d{1,6})?|True|False|native|cudaMallocAsync", "a number, True, False, native or "
                     "cudaMallocAsync")

ENV_TABLE: Dict[str, Value] = {
    # threads
    "OMP_NUM_THREADS": _THREADS, "MKL_NUM_THREADS": _THREADS, "OPENBLAS_NUM_THREADS": _THREADS,
    "OMP_PROC_BIND": choice("true", "false", "close", "spread", "master", "primary"),
    "OMP_WAIT_POLICY": choice("ACTIVE", "PASSIVE"),
    "MKL_THREADING_LAYER": choice("INTEL", "GNU", "SEQUENTIAL", "TBB"),
    "TOKENIZERS_PARALLELISM": TRUE_FALSE,
    # networks and collectives
    "NCCL_SOCKET_IFNAME": INTERFACES, "GLOO_SOCKET_IFNAME": INTERFACES,
    "NCCL_SOCKET_NTHREADS": integer(1, 16), "NCCL_NSOCKS_PERTHREAD": integer(1, 64),
    "NCCL_DEBUG": choice("VERSION", "WARN", "INFO", "TRACE"),
    "NCCL_DEBUG_SUBSYS": shape(r"\^?(?:INIT|COLL|P2P|SHM|NET|GRAPH|TUNING|ENV|ALLOC|CALL|PROXY|NVLS|BOOTSTRAP|REG|"
                               r"PROFILE|RAS|ALL)(?:,(?:INIT|COLL|P2P|SHM|NET|GRAPH|TUNING|ENV|ALLOC|CALL|PROXY|NVLS|"
                               r"BOOTSTRAP|REG|PROFILE|RAS|ALL))*", "NCCL subsystems such as INIT,NET"),
    "NCCL_ALGO": shape(r"\^?(?:%s)(?:,(?:%s))*" % ("|".join(_NCCL_ALGOS), "|".join(_NCCL_ALGOS)),
                       "NCCL algorithms: " + ", ".join(_NCCL_ALGOS)),
    "NCCL_PROTO": shape(r"\^?(?:LL|LL128|Simple)(?:,(?:LL|LL128|Simple))*", "NCCL protocols: LL, LL128, Simple"),
    "NCCL_P2P_DISABLE": BOOL01, "NCCL_SHM_DISABLE": BOOL01, "NCCL_NVLS_ENABLE": BOOL01, "NCCL_CUMEM_ENABLE": BOOL01,
    "NCCL_P2P_LEVEL": choice("LOC", "NVL", "PIX", "PXB", "PHB", "SYS", "0", "1", "2", "3", "4", "5"),
    "NCCL_NET_GDR_LEVEL": choice("LOC", "PIX", "PXB", "PHB", "SYS", "0", "1", "2", "3", "4", "5"),
    "NCCL_CROSS_NIC": choice("0", "1", "2"), "NCCL_BUFFSIZE": integer(65536, 1 << 31),
    "NCCL_NTHREADS": choice("64", "128", "256", "512"),
    "NCCL_MIN_NCHANNELS": integer(1, 64), "NCCL_MAX_NCHANNELS": integer(1, 64),
    "NCCL_LAUNCH_MODE": choice("PARALLEL", "GROUP"),
    "NCCL_IB_DISABLE": BOOL01, "NCCL_IB_CUDA_SUPPORT": BOOL01, "NCCL_IB_ADAPTIVE_ROUTING": BOOL01,
    "NCCL_IB_HCA": shape(r"[\^=]{0,2}[A-Za-z0-9_]{1,32}(?::\d{1,3})?(?:,[A-Za-z0-9_]{1,32}(?::\d{1,3})?)*",
                         "InfiniBand adapters such as mlx5_0:1,mlx5_1"),
    "NCCL_IB_GID_INDEX": integer(0, 255), "NCCL_IB_TC": integer(0, 255), "NCCL_IB_SL": integer(0, 15),
    "NCCL_IB_TIMEOUT": integer(1, 31), "NCCL_IB_RETRY_CNT": integer(0, 7),
    "NCCL_IB_QPS_PER_CONNECTION": integer(1, 128), "NCCL_IB_PCI_RELAXED_ORDERING": choice("0", "1", "2"),
    "NCCL_IB_ADDR_FAMILY": choice("AF_INET", "AF_INET6"), "NCCL_IB_ROCE_VERSION_NUM": choice("1", "2"),
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": choice("0", "1", "2", "3"), "TORCH_NCCL_BLOCKING_WAIT": BOOL01,
    "TORCH_NCCL_ENABLE_MONITORING": BOOL01, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": integer(1, 86400),
    "TORCH_DISTRIBUTED_DEBUG": choice("OFF", "INFO", "DETAIL"),
    "FI_PROVIDER": NAME, "FI_EFA_USE_DEVICE_RDMA": BOOL01,
    "UCX_TLS": shape(r"\^?[a-z_]{1,16}(?:,[a-z_]{1,16})*", "UCX transports such as rc,sm,self"),
    "UCX_NET_DEVICES": shape(r"[A-Za-z0-9_.]{1,32}(?::\d{1,3})?(?:,[A-Za-z0-9_.]{1,32}(?::\d{1,3})?)*",
                             "network devices such as mlx5_0:1"),
    # devices, memory, logging to the console
    "CUDA_DEVICE_MAX_CONNECTIONS": integer(1, 32), "CUDA_LAUNCH_BLOCKING": BOOL01,
    "CUDA_VISIBLE_DEVICES": shape(r"\d{1,3}(?:,\d{1,3})*", "device numbers such as 0,1"),
    "CUDA_MODULE_LOADING": choice("LAZY", "EAGER"), "NVIDIA_TF32_OVERRIDE": BOOL01,
    "PYTORCH_CUDA_ALLOC_CONF": key_values(_ALLOC_KEYS, _ALLOC_VALUE, assign=":"),
    "TORCH_CPP_LOG_LEVEL": choice("INFO", "WARNING", "ERROR", "FATAL"), "TORCH_SHOW_CPP_STACKTRACES": BOOL01,
    "DS_ACCELERATOR": choice("cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu", "sdaa"),
    "TRANSFORMERS_VERBOSITY": choice("debug", "info", "warning", "error", "critical"),
    "HF_HUB_OFFLINE": BOOL01, "HF_DATASETS_OFFLINE": BOOL01, "TRANSFORMERS_OFFLINE": BOOL01,
    "HF_HUB_DISABLE_TELEMETRY": BOOL01, "HF_HUB_DISABLE_PROGRESS_BARS": BOOL01,
}


# Set for the ranks this node starts unless the user's environment or launcher.env names it (run/launch/process.py):
# torch's C++ warnings are noise on the console once a rank's cause was said - when rank 0, the host of the job's
# TCPStore, ends first, a surviving rank's next store call (its heartbeat's beat) printed '[W ... TCPStore.cpp:125]
# [c10d] recvValue failed ... Connection reset by peer' and a C++ stack. torch reads the level when it is imported,
# so only the environment a rank starts with sets it. C++ errors (a NCCL watchdog's timeout) still show.
RANK_DEFAULTS: Dict[str, str] = {"TORCH_CPP_LOG_LEVEL": "ERROR"}


def rank_defaults(environ: Mapping[str, str]) -> Dict[str, str]:
    """RANK_DEFAULTS that `environ` (the launching process's) does not set: the user's own value is kept."""
    return {name: value for name, value in RANK_DEFAULTS.items() if name not in environ}


def env_problems(env: Mapping[str, str]) -> List[str]:
    """`launcher.env.NAME: ...` for every name outside ENV_TABLE and every value not of its type."""
    problems = []
    for name, value in env.items():
        where = f"{KEY}.{name}"
        if name not in ENV_TABLE:
            problems.append(f"{where}: not an allowed variable; launcher.env takes only the documented tuning "
                            "variables (README, Trust model: OMP_NUM_THREADS, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, "
                            "NCCL_IB_*, ...), never one that loads code or reads or writes a path; export others "
                            "yourself")
        else:
            wrong = ENV_TABLE[name].check(str(value))
            if wrong:
                problems.append(f"{where}: needs {wrong}, got {str(value)!r}")
    return problems


def checked_env(env: Mapping[str, str]) -> Dict[str, str]:
    """`launcher.env` after `env_problems` (ConfigError when any): the only way it reaches a rank."""

    problems = env_problems(env)
    if problems:
        raise ConfigError(problems)
    return {str(k): str(v) for k, v in env.items()}


# Object-store settings that are not secrets (issue 23): the launching process's own values travel to pdsh's remote
# ranks through `.deepspeed_env` (DeepSpeed's runner forwards only PYTHON*, MLFLOW*, MV2* and UCX* names itself, and
# writes `.deepspeed_env` into the command it runs on each node: so each value must be a plain URL or name). Keys,
# secrets and tokens never travel: remote nodes read their own ~/.aws/credentials, profile or instance role.
_URL = shape(r"https?://[A-Za-z0-9.\-]{1,253}(?::\d{1,5})?(?:/[A-Za-z0-9._~\-/]{0,200})?", "an http(s) URL")
_STORE_NAME = shape(r"[A-Za-z0-9._\-]{1,64}", "a region or profile name")
STORE_SETTINGS: Dict[str, Value] = {"AWS_ENDPOINT_URL": _URL, "AWS_ENDPOINT_URL_S3": _URL, "AWS_REGION": _STORE_NAME,
                                    "AWS_DEFAULT_REGION": _STORE_NAME, "AWS_PROFILE": _STORE_NAME}
STORE_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN")


def store_settings_from(environ: Mapping[str, str]) -> Tuple[Dict[str, str], List[str]]:
    """(the STORE_SETTINGS of the launching environment for remote ranks, notes): a value that is not a plain URL or
    name stays behind with a note; the secrets set here are named in a note (they never travel)."""
    settings: Dict[str, str] = {}
    notes: List[str] = []
    for name, value in STORE_SETTINGS.items():
        if name not in environ:
            continue
        problem = value.check(environ[name])
        if problem is None:
            settings[name] = environ[name]
        else:
            notes.append(f"{name} is not passed to the other nodes: {problem}; set it in their own environment")
    secrets = [name for name in STORE_SECRETS if environ.get(name)]
    if secrets:
        notes.append(f"{', '.join(secrets)} stay on this node (secrets never go into .deepspeed_env): the other "
                     "nodes' ranks read their own credentials (~/.aws/credentials, AWS_PROFILE, an instance role, "
                     "the Hugging Face token file)")
    return settings, notes
