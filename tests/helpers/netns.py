"""Network namespaces as cluster nodes, for real multi-node tests on one machine (root only).

`Cluster(n, workdir)` builds n "nodes": namespace `<tag>-n<i>` holds one veth end named IFNAME (the same name on
every node, so one `GLOO_SOCKET_IFNAME=dsr0` fits every rank, as one NIC name does on a real cluster) with the
address SUBNET.<i+1>/24, lo up. The other veth ends are ports of a bridge that lives in a namespace of its own
(`<tag>-sw`), so nothing at all is added to the machine's own network: the addresses exist only between the
namespaces this module created, and two clusters built at the same time (another test session) cannot see each
other even though they use the same subnet. The file system is shared, as on a cluster with a shared home.

`cluster.add_host(name)` adds one more namespace on the same bridge for a service the nodes reach by its address
(an object store: tests/helpers/s3server.py runs moto there); it is not a training node and `link(False)` cuts it off.

`cluster.start_sshd()` starts one `sshd` per node on its own port with throwaway keys (host key, user key,
authorized_keys, config: all in the cluster's work directory), and prepares a client directory (`config`,
`id_ed25519`) that `launching_argv()` bind-mounts over ~/.ssh inside `unshare -m`: the launching side's ssh and
pdsh see the cluster's hosts while the machine's own ~/.ssh stays untouched (when ~/.ssh does not exist, the home
directory is overlaid with a tmpfs-backed layer inside that private mount namespace, so nothing is created there).

`close()` kills every process in the cluster's namespaces and deletes them (the veth pairs and bridge go with
them); `Cluster` is a context manager, and namespaces left behind by a test session that died (its pid is gone)
are removed the next time a cluster is built. Only names with our prefix and a dead owner pid are touched.
"""

from __future__ import annotations

import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

PREFIX = "dsrt"  # namespace names: dsrt<pid>x<k>-n<i> / -sw
IFNAME = "dsr0"
SUBNET = "10.213.0"
SSH_BASE_PORT = 2200  # node i: sshd on port 2200 + i
SSHD = "/usr/sbin/sshd"
_counter = [0]


def unavailable_reason() -> Optional[str]:
    """Why namespaces cannot be built here (a skip reason), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the multi-node tests as root"
    for tool in ("ip", "unshare", "ss"):
        if shutil.which(tool) is None:
            return f"{tool} not found (apt-get install iproute2 util-linux)"
    name = f"{PREFIX}{os.getpid()}probe"
    done = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if done.returncode != 0:
        return f"cannot create a network namespace: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def ssh_unavailable_reason() -> Optional[str]:
    missing = [t for t in ("ssh", "ssh-keygen", "pdsh") if shutil.which(t) is None]
    if not os.access(SSHD, os.X_OK):
        missing.append(SSHD)
    if missing:
        return f"{', '.join(missing)} not found (apt-get install openssh-server openssh-client pdsh)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def namespace_pids(ns: str) -> List[int]:
    done = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []


def kill_namespace(ns: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in `ns` (repeat: a dying process may still fork)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [p for p in namespace_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def remove_stale() -> None:
    """Delete namespaces of test sessions that died without cleaning up (owner pid gone)."""
    listing = _ip("netns", "list", check=False).stdout
    for name in re.findall(rf"^({PREFIX}(\d+)x\d+-\w+)", listing, flags=re.M):
        ns, pid = name
        try:
            os.kill(int(pid), 0)
            continue  # its session is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        kill_namespace(ns)
        _ip("netns", "del", ns, check=False)


@dataclass
class Node:
    index: int
    ns: str
    addr: str
    ssh_port: int
    hosts_file: Path  # node<i> -> address for every node, mounted over /etc/hosts on the node
    name: str = ""  # a service host's name (`Cluster.add_host`); training nodes are node<i>

    @property
    def host(self) -> str:
        return self.name or f"node{self.index}"

    def argv(self, argv: Sequence[str], setup: Sequence[str] = ()) -> List[str]:
        """`argv` on this node: its network namespace, its own hostname (UTS namespace) and /etc/hosts (private
        mount namespace), as on a real node, where the hostname resolves to the node's address (torchrun's c10d
        rendezvous decides who hosts its store that way)."""
        script = ["set -e", f"hostname {self.host}", f"mount --bind {shlex.quote(str(self.hosts_file))} /etc/hosts"]
        script += [*setup, 'exec "$@"']
        unshare = ["unshare", "--uts", "--mount", "--propagation", "private"]
        return ["ip", "netns", "exec", self.ns, *unshare, "sh", "-c", "\n".join(script), "sh", *argv]

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.argv(argv), **kwargs)

    def run(self, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.argv(argv), **kwargs)

    def pids(self) -> List[int]:
        return namespace_pids(self.ns)

    def kill(self) -> None:
        """The node dies: every process in its namespace is killed (SIGKILL)."""
        kill_namespace(self.ns)

    def link(self, up: bool) -> None:
        _ip("-n", self.ns, "link", "set", IFNAME, "up" if up else "down")

    def listening(self, port: int) -> bool:
        out = subprocess.run(["ip", "netns", "exec", self.ns, "ss", "-Hltn", f"sport = :{port}"],
                             capture_output=True, text=True).stdout
        return bool(out.strip())


class Cluster:
    def __init__(self, nodes: int, workdir: Path):
        remove_stale()
        _counter[0] += 1
        self.tag = f"{PREFIX}{os.getpid()}x{_counter[0]}"
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.switch = f"{self.tag}-sw"
        hosts = self.workdir / "hosts"
        self.nodes = [Node(i, f"{self.tag}-n{i}", f"{SUBNET}.{i + 1}", SSH_BASE_PORT + i, hosts) for i in range(nodes)]
        hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.host}\n" for n in self.nodes))
        self.services: List[Node] = []  # add_host: namespaces on the same bridge that are not training nodes
        self._procs: List[subprocess.Popen] = []
        self.ssh_dir: Optional[Path] = None
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for node in self.nodes:
            self._attach(node)

    def _attach(self, node: Node) -> None:
        """`node`'s namespace, lo up, and a veth from it (IFNAME, its address) to a port of the bridge."""
        _ip("netns", "add", node.ns)
        _ip("-n", node.ns, "link", "set", "lo", "up")
        port = f"p{node.index}"
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", node.ns)
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        _ip("-n", node.ns, "addr", "add", f"{node.addr}/24", "dev", IFNAME)
        _ip("-n", node.ns, "link", "set", IFNAME, "up")

    def add_host(self, name: str) -> Node:
        """One more namespace on the same bridge for a service the nodes use (an object store, say): not a
        training node (not in `nodes` nor the hostfile), address SUBNET.<101+k>, reached by the nodes only through
        the bridge; `link(False)` cuts it off. Killed and deleted with the cluster."""
        index = 100 + len(self.services)
        node = Node(index, f"{self.tag}-{name}", f"{SUBNET}.{index + 1}", 0, self.workdir / "hosts", name)
        self.services.append(node)
        self._attach(node)
        return node

    # -------------------------------------------------------------------------------------------------------
    # ssh

    def start_sshd(self, timeout: float = 20.0) -> Path:
        """One sshd per node (own port, throwaway keys); returns the client dir to mount over ~/.ssh."""
        keys = self.workdir / "ssh-keys"
        client = self.workdir / "ssh-client"
        keys.mkdir(mode=0o700, exist_ok=True)
        client.mkdir(mode=0o700, exist_ok=True)
        for path in (keys / "host_ed25519", client / "id_ed25519"):
            if not path.exists():
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
        shutil.copy(client / "id_ed25519.pub", keys / "authorized_keys")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory (Debian)
        lines = []
        for node in self.nodes:
            lines += [f"Host {node.host}", f"  HostName {node.addr}", f"  Port {node.ssh_port}"]
        user = pwd.getpwuid(os.getuid())
        # What a plain user config says: no ServerAlive probes, so ssh to a dead host hangs (as pdsh then does).
        lines += [
            "Host *", f"  User {user.pw_name}", f"  IdentityFile {user.pw_dir}/.ssh/id_ed25519", "  IdentitiesOnly yes",
            "  BatchMode yes", "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null", "  LogLevel ERROR",
        ]  # fmt: skip
        (client / "config").write_text("\n".join(lines) + "\n")
        self.ssh_dir = client
        for node in self.nodes:
            self.start_node_sshd(node, timeout)
        return client

    def start_node_sshd(self, node: Node, timeout: float = 20.0) -> None:
        keys = self.workdir / "ssh-keys"
        conf = keys / f"sshd_{node.host}.conf"
        conf.write_text(
            f"Port {node.ssh_port}\nListenAddress {node.addr}\nHostKey {keys / 'host_ed25519'}\n"
            f"PidFile {keys / f'sshd_{node.host}.pid'}\nAuthorizedKeysFile {keys / 'authorized_keys'}\n"
            "StrictModes no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
            "PermitRootLogin prohibit-password\nMaxStartups 64\nMaxSessions 64\nLogLevel ERROR\n"
            "PrintMotd no\nPrintLastLog no\n"
        )
        log_path = keys / f"sshd_{node.host}.log"
        with open(log_path, "ab") as log:
            self._procs.append(node.popen([SSHD, "-D", "-e", "-f", str(conf)], stdout=log, stderr=log))
        deadline = time.monotonic() + timeout
        while not node.listening(node.ssh_port):
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {node.host} did not start: {log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)

    def revive(self, node: Node) -> None:
        """A killed node comes back: link up, sshd again (when the cluster has ssh)."""
        node.link(True)
        if self.ssh_dir is not None:
            self.start_node_sshd(node)

    def launching_argv(self, node: Node, argv: Sequence[str]) -> List[str]:
        """`argv` on `node` in a private mount namespace whose ~/.ssh is the cluster's client directory."""
        home = pwd.getpwuid(os.getuid()).pw_dir
        script: List[str] = []
        if self.ssh_dir is not None:
            if not os.path.isdir(f"{home}/.ssh"):
                # No ~/.ssh to mount over: overlay the home directory in this mount namespace only (upper layer on
                # a private tmpfs), so the mount point exists here and nothing is created in the real home.
                layer = self.workdir / "home-layer"
                layer.mkdir(exist_ok=True)
                script += [
                    f"mount -t tmpfs tmpfs {shlex.quote(str(layer))}",
                    f"mkdir {shlex.quote(str(layer))}/u {shlex.quote(str(layer))}/w",
                    f"mount -t overlay overlay -o lowerdir={home},upperdir={layer}/u,workdir={layer}/w {home}",
                    f"mkdir -m 700 {home}/.ssh",
                ]
            script.append(f"mount --bind {shlex.quote(str(self.ssh_dir))} {home}/.ssh")
        return node.argv(argv, setup=script)

    def hostfile(self, slots: int) -> str:
        return "".join(f"{n.host} slots={slots}\n" for n in self.nodes)

    # -------------------------------------------------------------------------------------------------------

    def close(self) -> None:
        for node in [*self.nodes, *self.services]:
            kill_namespace(node.ns)
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        for ns in [n.ns for n in [*self.nodes, *self.services]] + [self.switch]:
            _ip("netns", "del", ns, check=False)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def environ_of(pid: int) -> Dict[str, str]:
    """The environment a running process was started with (/proc/PID/environ)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def cmdline_of(pid: int) -> List[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []
