"""Where a rank runs, as the heartbeat (core/heartbeat.py) and the rendezvous (core/rendezvous.py) record it in the
job's store for the messages that name a failed node."""

from __future__ import annotations

import os
import socket
from typing import Any, Dict, Optional


def whoami(rank: int, master_addr: str) -> Dict[str, Any]:
    """This rank's place: node rank (deepspeed: CROSS_RANK, torchrun: GROUP_RANK), host name, cluster address."""
    node = os.environ.get("CROSS_RANK") or os.environ.get("GROUP_RANK")
    return {"rank": rank, "node": int(node) if node and node.isdigit() else None, "host": socket.gethostname(),
            "addr": route_address(master_addr), "pid": os.getpid(), "local_rank": os.environ.get("LOCAL_RANK")}  # fmt: skip


def route_address(master_addr: str) -> Optional[str]:
    """The local address this node uses to reach the master (no packet is sent: UDP connect only routes)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))
            return s.getsockname()[0]
    except OSError:
        return None
