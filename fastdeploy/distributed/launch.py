"""Where this process sits among the ranks of a model spread over several nodes.

Under `python -m paddle.distributed.launch` the launcher gives each process its place in standard variables
(PADDLE_TRAINER_ID, PADDLE_TRAINERS_NUM, PADDLE_MASTER, PADDLE_LOCAL_RANK, PADDLE_LOCAL_SIZE,
PADDLE_TRAINER_ENDPOINTS); reading them is a pass-through of what the launcher decided, not a switch. With one
process in all (or no launcher), `Launch.from_environ` is None and tensor parallel starts its own workers on this host.

Without a launcher, FastDeploy's `ips=` form runs the same command on every node: `Launch.from_ips` finds this
node in the list (the address of it that is this host's), and the node's first rank starts the node's others.
"""
from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

_HINT = ("start every node with the same `python -m paddle.distributed.launch --master HOST:PORT --nnodes N` "
         "(or `--ips ip1,ip2` with `--host <this node's address>`), or without it pass ips=, see docs/distributed.md")


@dataclass(frozen=True, slots=True)
class Launch:
    rank: int  # global rank: 0 runs the engine, the others serve its steps
    world_size: int
    local_rank: int  # among the ranks on this node
    local_size: int
    master_host: str  # rank 0's rendezvous store (PADDLE_MASTER)
    master_port: int
    endpoints: tuple[str, ...]  # every rank's host:port, by rank
    starts_node_ranks: bool = False  # ips= without a launcher: this process starts local ranks 1.. of its node

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

    @classmethod
    def from_ips(cls, ips: list[str], world_size: int, port: int) -> Launch:
        """This node's first rank, for the same command run on every node of `ips` (master first) without a
        launcher: `world_size` ranks split evenly over the nodes, rank 0's store at ips[0]:`port`."""
        if world_size % len(ips):
            raise ValueError(f"tensor_parallel_size={world_size} does not split evenly over the {len(ips)} nodes of "
                             f"ips={','.join(ips)}: each node runs tensor_parallel_size / len(ips) ranks")
        if len(set(ips)) != len(ips):
            raise ValueError(f"ips lists a node twice: {','.join(ips)}")
        per_node = world_size // len(ips)
        node = _this_node(ips, port)
        endpoints = tuple(f"{ips[r // per_node]}:{port}" for r in range(world_size))
        return cls(node * per_node, world_size, 0, per_node, ips[0], port, endpoints, per_node > 1)

    def check_rank_zero_here(self) -> None:
        """Rank 0 must be on the master's host: a node whose launcher could not tell its own address from the
        --ips list also takes rank 0 (and would wait for workers that never come)."""
        if self.rank == 0 and not is_local_address(self.master_host):
            raise ValueError(f"paddle.distributed.launch made this process rank 0, but the master address "
                             f"{self.master_host} (PADDLE_MASTER) is not one of this host's: two nodes took rank 0. "
                             f"Give each node's launcher `--host <its own address>`; {_HINT}")


def _this_node(ips: list[str], port: int) -> int:
    """The index in `ips` of this host's address. When it lists several (every node on one machine, to try it
    out), the first started is the master (nothing answers at ips[0]:`port` yet) and the second the other."""
    here = [i for i, ip in enumerate(ips) if is_local_address(ip)]
    if not here:
        raise ValueError(f"none of ips={','.join(ips)} is an address of this host; list every node's address as "
                         "the other nodes reach it, the same list on every node")
    if len(here) == 1:
        return here[0]
    if here[0] == 0 and not answers(ips[0], port):
        return 0
    others = [i for i in here if i != 0]
    if len(others) == 1:
        return others[0]
    raise ValueError(f"ips={','.join(ips)} lists {len(here)} addresses of this host, so it cannot tell which node it "
                     "is; to run several nodes on one host, start them under paddle.distributed.launch with --rank")


def answers(host: str, port: int) -> bool:
    """Whether something accepts connections at host:port."""
    try:
        socket.create_connection((host, port), timeout=2.0).close()
        return True
    except OSError:
        return False


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
