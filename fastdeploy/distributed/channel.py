"""A message channel between rank 0 and one worker: length-prefixed pickles over a localhost TCP socket.

Only rank 0 and the workers it started use it: a worker proves it is one by sending the random
token rank 0 handed it through its stdin, before anything is unpickled on either side.
"""
from __future__ import annotations

import errno
import logging
import pickle
import socket
import struct
from typing import Any

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
_LENGTH = struct.Struct("<Q")


class ChannelClosed(ConnectionError):
    """The other end closed the channel (or died)."""


def send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ChannelClosed("channel closed by the other end")
        got += k
    return buf


def recv(sock: socket.socket) -> Any:
    """The next message; blocks (no polling) until it arrives. ChannelClosed at end of stream."""
    (n,) = _LENGTH.unpack(_recv_exact(sock, _LENGTH.size))
    return pickle.loads(_recv_exact(sock, n))


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    return bytes(_recv_exact(sock, n))


def connect(port: int, timeout_s: float = 30.0) -> socket.socket:
    sock = socket.create_connection((HOST, port), timeout=timeout_s)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small step messages go out at once
    return sock


def listen_from(port: int) -> socket.socket:
    """A listening socket on `port`, or on the next free port above it (logged) when it is taken."""
    for candidate in range(port, 65536):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # A previous LLM's connections may linger in TIME_WAIT on this port; an active listener still refuses.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, candidate))
        except OSError as e:
            sock.close()
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                continue
            raise
        sock.listen()
        if candidate != port:
            logger.info("engine_worker_queue_port %d is in use; the tensor-parallel workers use port %d",
                        port, candidate)
        return sock
    raise ValueError(f"engine_worker_queue_port: no free port in [{port}, 65535]")

