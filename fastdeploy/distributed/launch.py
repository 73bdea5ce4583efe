"""Where this process sits when `python -m paddle.distributed.launch` started it on several nodes.

The launcher gives each process its place in standard variables (PADDLE_TRAINER_ID, PADDLE_TRAINERS_NUM,
PADDLE_MASTER, PADDLE_LOCAL_RANK, PADDLE_LOCAL_SIZE, PADDLE_TRAINER_ENDPOINTS, PADDLE_CURRENT_ENDPOINT);
reading them is a pass-through of what the launcher decided, not a switch. With one process in all
(or no launcher), `Launch.from_environ` is None and tensor parallel starts its own workers on this host.
"""
from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

_HINT = ("start every node with the same `python -m paddle.distributed.launch --master HOST:PORT --nnodes N` "
         "(or `--ips ip1,ip2` with `--host <this node's address>`), see docs/distributed.md")


@dataclass(frozen=True, slots=True)
class Launch:
    rank: int  # global rank: 0 runs the engine, the others serve its steps
    world_size: int
    local_rank: int  # among the ranks on this node
    local_size: int
    master_host: str  # rank 0's rendezvous store (PADDLE_MASTER)
    master_port: int
    endpoints: tuple[str, ...]  # every rank's host:port, by rank

    @property
    def nodes(self) -> list[str]:
        """The distinct hosts of the ranks, in rank order."""
        return list(dict.fromkeys(e.rsplit(":", 1)[0] for e in self.endpoints))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Launch | None:  # env-ok: the launcher's ranks
        """This process's place, or None when no launcher started it or it started a single process."""
        if "PADDLE_TRAINERS_NUM" not in environ:
            return None
        world = _int(environ, "PADDLE_TRAINERS_NUM", 1)
        if world == 1:
            return None
        rank = _int(environ, "PADDLE_TRAINER_ID", 0, world - 1)
        local_size = _int(environ, "PADDLE_LOCAL_SIZE", 1, world, default=1)
        local_rank = _int(environ, "PADDLE_LOCAL_RANK", 0, local_size - 1, default=0)
        endpoints = tuple(e for e in environ.get("PADDLE_TRAINER_ENDPOINTS", "").split(",") if e)
        if len(endpoints) != world:
            raise ValueError(f"PADDLE_TRAINER_ENDPOINTS lists {len(endpoints)} endpoints for "
                             f"PADDLE_TRAINERS_NUM={world} ranks; {_HINT}")
        master = environ.get("PADDLE_MASTER") or endpoints[0]
        host, _, port = master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"PADDLE_MASTER must be HOST:PORT, got {master!r}; {_HINT}")
        return cls(rank, world, local_rank, local_size, host, int(port), endpoints)

    def check_rank_zero_here(self) -> None:
        """Rank 0 must be on the master's host: a node whose launcher could not tell its own address from the
        --ips list also takes rank 0 (and would wait for workers that never come)."""
        if self.rank == 0 and not is_local_address(self.master_host):
            raise ValueError(f"paddle.distributed.launch made this process rank 0, but the master address "
                             f"{self.master_host} (PADDLE_MASTER) is not one of this host's: two nodes took rank 0. "
                             f"Give each node's launcher `--host <its own address>` and set GLOO_SOCKET_IFNAME to the "
                             f"interface of that address; {_HINT}")


def is_local_address(host: str) -> bool:
    """Whether `host` names an address of this machine (one a socket can bind)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address[0], 0))
                return True
            except OSError as e:
                if e.errno != errno.EADDRNOTAVAIL:
                    raise
    return False


def _int(environ: Mapping[str, str], name: str, low: int, high: int | None = None, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None and default is not None:
        return default
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {text!r}; {_HINT}") from None
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name}={value} is outside [{low}, {high}]; {_HINT}")
    return value
