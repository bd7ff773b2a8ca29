"""The initial rendezvous, bounded: every rank of the job arrives within `launcher.rendezvous_timeout_s`, or the run
ends with one message naming the ranks (and their nodes) that never arrived.

torch.distributed's own rendezvous (env://) waits as long as the process-group timeout (30 minutes by default) for
a rank that never comes: rank 0's TCPStore waits for every worker, the others retry connecting to rank 0. So before
joining the process group every rank meets the others in that same store (MASTER_ADDR:MASTER_PORT): rank 0 starts
it as a multi-tenant server, which torch's `init_process_group` then reuses (torchrun: its agent's store, where every
rank is a client), each rank writes where it runs and adds itself to a counter, and waits until all have arrived,
printing whom it waits for (the first rank of each node), up to the bound. A stop signal ends the wait too. The
process group itself, and its collective timeout, are created afterwards exactly as before.

Torch-free at import: torch.distributed is loaded by `meet` (the ranks only).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional

import dsrecipes.core.stopping as stopping
from dsrecipes.core.errors import RunInterrupted, UserError
from dsrecipes.core.whoami import whoami

PREFIX = "dsrecipes/rendezvous"
POLL_S = 0.2
FIRST_NOTE_S = 5.0  # the first "waiting for ..." line after this long (or half the bound), then every NOTE_EVERY_S
NOTE_EVERY_S = 30.0
CONNECT_TRY_S = 2.0  # one connection attempt to the store's host (a client retries until the bound)
STORE_OP_TIMEOUT = timedelta(minutes=30)  # store operations here never block (add, set, check)

_servers: List[Any] = []  # rank 0's store, alive until torch's init_process_group has reused its server


class RendezvousTimeout(UserError):
    """Ranks that never reached the initial rendezvous within launcher.rendezvous_timeout_s."""


class RendezvousLost(UserError):
    """The rendezvous store's host (rank 0, or torchrun's agent) went away while this rank waited there."""


def meet(timeout_s: float) -> None:
    """Wait until every rank of the job (RANK, WORLD_SIZE, MASTER_ADDR/MASTER_PORT in the environment) has arrived;
    RendezvousTimeout after `timeout_s` seconds. A lone process returns at once."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return
    _Meeting(int(os.environ.get("RANK", "0")), world, float(timeout_s)).run()


def local_size() -> Optional[int]:
    """Ranks per node, as the launcher said it (deepspeed, torchrun, Open MPI); None where unknown."""
    for key in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def describe(ranks: List[int], per_node: Optional[int]) -> str:
    """'rank 1 (node 0)', 'ranks 2, 3 (node 1); rank 5 (node 2)' (nodes by the launcher's placement: rank //
    ranks per node), or just the ranks where the placement is unknown."""
    groups: Dict[Optional[int], List[int]] = {}
    for r in sorted(ranks):
        groups.setdefault(r // per_node if per_node else None, []).append(r)
    parts = []
    for node, members in groups.items():
        text = f"rank{'s' if len(members) > 1 else ''} {', '.join(map(str, members))}"
        parts.append(text if node is None else f"{text} (node {node})")
    return "; ".join(parts)


class _Meeting:
    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.host, self.port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self.prefix = f"{PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.per_node = local_size()
        self.agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's, else rank 0's
        self.notes = os.environ.get("LOCAL_RANK", "0") == "0"  # one line per node, not one per rank
        self.started = time.monotonic()
        self.next_note = self.started + min(FIRST_NOTE_S, timeout_s / 2)

    def run(self) -> None:
        store = self._connect()
        store.set(self._who(self.rank), json.dumps(whoami(self.rank, self.host)))
        store.add(f"{self.prefix}/arrived", 1)
        while not self._all_here(store):
            try:
                self._tick(lambda: self._missing(store))
            except RendezvousTimeout as exc:  # the first rank out of time tells the others, who end with it
                with contextlib.suppress(RuntimeError):
                    store.set(f"{self.prefix}/expired", str(exc))
                    if self.rank == 0:
                        time.sleep(5 * POLL_S)  # the store's host: the others read it before the store goes
                raise
            time.sleep(POLL_S)

    def _all_here(self, store: Any) -> bool:
        """Every rank arrived; RendezvousTimeout when another rank ran out of time first; RendezvousLost when the
        store's host is gone (rank 0 died while the others waited)."""
        try:
            if store.check([f"{self.prefix}/expired"]):
                raise RendezvousTimeout(store.get(f"{self.prefix}/expired").decode())
            return store.add(f"{self.prefix}/arrived", 0) >= self.world
        except RuntimeError:  # (torch's DistNetworkError: connection reset)
            host = "torchrun's agent on node 0" if self.agent_store else "rank 0"
            raise RendezvousLost(f"{host}, which hosts the rendezvous store at {self.host}:{self.port}, went away "
                                 f"while rank {self.rank} waited there: it ended before every rank joined; see the "
                                 "run's logs/rank0.log and the launcher's output for node 0") from None

    def _missing(self, store: Any) -> List[int]:
        try:
            return [r for r in range(self.world) if not store.check([self._who(r)])]
        except RuntimeError:  # the store's host went away just now: the next look says so
            return []

    def _who(self, rank: int) -> str:
        return f"{self.prefix}/who/{rank}"

    def _connect(self) -> Any:
        """Rank 0 starts the store (multi-tenant: torch's init_process_group reuses its server) unless torchrun's
        agent hosts it; the others connect, retrying until the bound."""
        from torch.distributed import TCPStore

        if self.rank == 0 and not self.agent_store:
            store = TCPStore(self.host, self.port, None, True, STORE_OP_TIMEOUT, wait_for_workers=False,
                             multi_tenant=True)
            _servers.append(store)
            return store
        while True:
            try:
                return TCPStore(self.host, self.port, None, False, timedelta(seconds=CONNECT_TRY_S),
                                wait_for_workers=False)
            except (RuntimeError, OSError):  # (torch's DistNetworkError / DistStoreError: not up yet)
                self._tick(lambda: [0], store_missing=True)

    def _tick(self, missing: Callable[[], List[int]], store_missing: bool = False) -> None:
        """A stop signal ends the wait (RunInterrupted), the bound ends it (RendezvousTimeout); in between, a line
        now and then saying whom this rank waits for."""
        signum = stopping.requested()
        if signum is not None:
            raise RunInterrupted(signum, 0)
        now = time.monotonic()
        waited = now - self.started
        if waited >= self.timeout_s:
            raise RendezvousTimeout(self._expired(missing(), store_missing))
        if self.notes and now >= self.next_note:
            self.next_note = now + NOTE_EVERY_S
            what = "the store's host" if store_missing else "every rank"
            print(f"dsrecipes: rank {self.rank}: waiting at the rendezvous ({self.host}:{self.port}) for {what}: "
                  f"{describe(missing(), self.per_node)} not arrived yet ({waited:.0f} s so far; gives up after "
                  f"launcher.rendezvous_timeout_s={self.timeout_s:.0f})", file=sys.stderr, flush=True)

    def _expired(self, missing: List[int], store_missing: bool) -> str:
        who = describe(missing, self.per_node)
        host = " (it hosts the rendezvous store)" if store_missing else ""
        logs = ", ".join(f"logs/rank{r}.log" for r in sorted(missing)[:4])
        return (f"launcher.rendezvous_timeout_s={self.timeout_s:.0f}: {who}{host} never reached the rendezvous at "
                f"{self.host}:{self.port} within {self.timeout_s:.0f} s - died or hung before joining, or its node "
                f"never started; see the run's {logs} and the launcher's output for that node")
