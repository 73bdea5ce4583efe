"""Collectives between tensor-parallel ranks on several hosts: a ring of TCP connections, each rank sending to the
next and receiving from the one before.

Why not Paddle's gloo group: its collectives cost ~0.5 ms each on loopback, against ~0.04 ms for a round trip over
a plain socket, and decode runs 2 of them per layer. Here a collective is a few `send` / `recv_into` calls of the
calling thread on non-blocking sockets (no I/O thread to hand over to):

- all-reduce: small tensors (every decode step's) go round the ring whole and each rank adds the parts in rank
  order; large ones are reduced in N chunks around the ring, each chunk summed once on one rank and passed on
  (2 (N-1) / N of the tensor sent per rank, the bandwidth a ring allows). Either way every rank holds the same bits.
- gather to rank 0 (the LM head's logits) and rank 0's step messages travel the ring, each rank passing them on.

A rank whose process ends closes its sockets, so the collective waiting on it fails at once; one that stops
answering fails it after TIMEOUT_S. The connections are unauthenticated, as the store they meet at (docs/security.md).
"""
from __future__ import annotations

import ctypes
import math
import secrets
import select
import socket
import struct
import time

import numpy as np
import paddle

from fastdeploy.distributed.launch import is_local_address
from fastdeploy.distributed.rendezvous import RankLost

TIMEOUT_S = 30.0  # a collective that a rank does not join for this long fails
MAX_MESSAGE_BYTES = 1 << 30  # a step's media included; a message announcing more is refused, not allocated
_WHOLE_BYTES = 1 << 16  # all-reduce sends tensors up to this size (per rank) whole: fewest round trips
_SPIN_S = 1e-4  # poll a socket that is not ready this long before sleeping in select: answers are often that close
_HELLO = struct.Struct("<4sI16s")  # magic, the connecting rank, the ring's token (from the store)
_MAGIC = b"FDRG"
_LENGTH = struct.Struct("<Q")


class RingComm:
    """One rank's collectives over the ring: all-reduce, gather to rank 0, rank 0's messages to the others."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self._next: socket.socket | None = None  # connected once every rank has loaded (connect)
        self._prev: socket.socket | None = None

    @property
    def attached(self) -> bool:
        return self._next is not None

    def connect(self, store, host: str) -> None:
        """Join the ring: listen on `host` (this rank's address the others reach), publish it in the store, connect
        to the next rank and accept the previous one."""
        if self.rank == 0:
            store.set("fastdeploy/ring/token", secrets.token_bytes(16))
        token = bytes(store.get("fastdeploy/ring/token"))
        with socket.create_server((host if is_local_address(host) else "", 0)) as listener:
            store.set(f"fastdeploy/ring/{self.rank}", f"{host}:{listener.getsockname()[1]}".encode())
            peer_host, _, port = bytes(store.get(f"fastdeploy/ring/{(self.rank + 1) % self.size}")).decode() \
                .rpartition(":")
            self._next = socket.create_connection((peer_host, int(port)), timeout=TIMEOUT_S)
            self._next.sendall(_HELLO.pack(_MAGIC, self.rank, token))
            listener.settimeout(TIMEOUT_S)
            prev = (self.rank - 1) % self.size
            while True:  # a stray connection (not the previous rank with the ring's token) is dropped
                try:
                    conn, _ = listener.accept()
                except socket.timeout:
                    raise RankLost(f"rank {prev} did not connect to rank {self.rank} within {TIMEOUT_S:g} s: "
                                   "check that the nodes reach each other's addresses") from None
                conn.settimeout(TIMEOUT_S)
                try:
                    hello = _recv_exact(conn, _HELLO.size)
                except OSError:
                    hello = b""
                if hello == _HELLO.pack(_MAGIC, prev, token):
                    self._prev = conn
                    break
                conn.close()
        for sock in (self._next, self._prev):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)

    def close(self) -> None:
        for sock in (self._next, self._prev):
            if sock is not None:
                sock.close()

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """The ranks' sum of x; the same bits on every rank."""
        flat = _numpy(x).reshape(-1)
        if self.size == 2 or flat.nbytes <= _WHOLE_BYTES:
            parts = self._all_gather(flat, "all-reduce")
            total = parts[0].copy()
            for part in parts[1:]:  # rank order, element by element: the same sums on every rank
                total += part
        else:
            total = self._ring_reduce(flat.copy())
        return _into(x.clone(), total)

    def min_int(self, value: int) -> int:
        return int(self._all_gather(np.asarray([value], np.int64), "all-reduce").min())

    def gather_to_first(self, x: paddle.Tensor) -> paddle.Tensor:
        """[size, *x.shape]: every rank's x in rank order, on rank 0 (the others get zeros: nobody reads them).
        Rank k receives ranks 1..k-1's parts from rank k-1 and passes them on with its own."""
        mine = _numpy(x)
        if self.rank == 0:
            out = np.empty((self.size, *mine.shape), mine.dtype)
            out[0] = mine
            self._shift(None, _bytes(out[1:]), "gather")
            return _into(paddle.empty(out.shape, dtype=x.dtype), out)
        parts = np.empty((self.rank, *mine.shape), mine.dtype)
        parts[-1] = mine
        self._shift(_bytes(parts), _bytes(parts[:-1]) if self.rank > 1 else None, "gather", receive_first=True)
        return paddle.zeros([self.size, *x.shape], dtype=x.dtype)

    def send(self, message: bytes) -> None:
        """Rank 0: a message to every other rank."""
        if len(message) > MAX_MESSAGE_BYTES:
            raise ValueError(f"a step message of {len(message)} bytes is over {MAX_MESSAGE_BYTES}: send fewer or "
                             "smaller media per step")
        self._shift(memoryview(_LENGTH.pack(len(message)) + message), None, "broadcast")

    def receive(self) -> bytes:
        """Ranks > 0: the next message rank 0 sends (passed on to the next rank first)."""
        head = bytearray(_LENGTH.size)
        self._shift(None, memoryview(head), "broadcast")
        (n,) = _LENGTH.unpack(head)
        if n > MAX_MESSAGE_BYTES:
            raise RankLost(f"rank 0 announced a step message of {n} bytes, more than {MAX_MESSAGE_BYTES}: refused")
        message = bytearray(n)
        self._shift(None, memoryview(message), "broadcast")
        if self.rank < self.size - 1:
            self._shift(memoryview(head + message), None, "broadcast")
        return bytes(message)

    def _all_gather(self, mine: np.ndarray, what: str) -> np.ndarray:
        """[size, *mine.shape]: every rank's array; at step s each rank passes on the part it got at step s-1."""
        parts = np.empty((self.size, *mine.shape), mine.dtype)
        parts[self.rank] = mine
        for s in range(self.size - 1):
            self._shift(_bytes(parts[(self.rank - s) % self.size]), _bytes(parts[(self.rank - s - 1) % self.size]),
                        what)
        return parts

    def _ring_reduce(self, acc: np.ndarray) -> np.ndarray:
        """Reduce-scatter (chunk c is summed along the ring, ending whole on rank c-1), then pass the sums round."""
        n = self.size
        bounds = [len(acc) * c // n for c in range(n + 1)]
        chunk = [acc[bounds[c]:bounds[c + 1]] for c in range(n)]
        got = np.empty(math.ceil(len(acc) / n) + 1, acc.dtype)
        for s in range(n - 1):
            out, into = chunk[(self.rank - s) % n], chunk[(self.rank - s - 1) % n]
            self._shift(_bytes(out), _bytes(got[:len(into)]), "all-reduce")
            into += got[:len(into)]
        for s in range(n - 1):
            self._shift(_bytes(chunk[(self.rank + 1 - s) % n]), _bytes(chunk[(self.rank - s) % n]), "all-reduce")
        return acc

    def _shift(self, out: memoryview | None, into: memoryview | None, what: str, receive_first: bool = False) -> None:
        """Send `out` to the next rank while receiving `into` from the previous one (or, with receive_first, all of
        `into` before any of `out`); a rank that is gone or silent for TIMEOUT_S is RankLost."""
        sent, got = 0, 0
        out_len, into_len = len(out) if out is not None else 0, len(into) if into is not None else 0
        deadline = time.monotonic() + TIMEOUT_S
        spin_until = time.monotonic() + _SPIN_S
        while sent < out_len or got < into_len:
            moved = False
            try:
                if got < into_len:
                    try:
                        n = self._prev.recv_into(into[got:])
                    except (BlockingIOError, InterruptedError):  # nothing to read yet
                        n = -1
                    if n == 0:
                        raise ConnectionResetError("closed")
                    if n > 0:
                        got, moved = got + n, True
                if sent < out_len and (got == into_len or not receive_first):
                    try:
                        sent, moved = sent + self._next.send(out[sent:]), True
                    except (BlockingIOError, InterruptedError):  # the send buffer is full
                        pass
            except OSError as e:
                raise RankLost(f"tensor-parallel {what} failed: another rank exited, or the network between them "
                               f"broke ({e})") from e
            now = time.monotonic()
            if moved:
                deadline, spin_until = now + TIMEOUT_S, now + _SPIN_S
                continue
            if now < spin_until:
                continue
            wait = deadline - now
            if wait <= 0:
                raise RankLost(f"tensor-parallel {what} failed: another rank did not answer for {TIMEOUT_S:g} s")
            readers = [self._prev] if got < into_len else []
            writers = [self._next] if sent < out_len and (got == into_len or not receive_first) else []
            select.select(readers, writers, readers + writers, wait)


_DTYPES = (paddle.float32, paddle.float16, paddle.float64, paddle.int32, paddle.int64)  # numpy's too


def _numpy(x: paddle.Tensor) -> np.ndarray:
    if x.dtype not in _DTYPES:  # bfloat16's numpy form would be summed as integers
        raise TypeError(f"tensor-parallel collectives across hosts take {[str(d) for d in _DTYPES]}, got {x.dtype}")
    return np.ascontiguousarray(x.numpy())


def _into(out: paddle.Tensor, array: np.ndarray) -> paddle.Tensor:
    """`array`'s bytes into `out` (a CPU tensor of its size): cheaper than paddle.to_tensor for a step's sizes."""
    ctypes.memmove(out.data_ptr(), array.ctypes.data, array.nbytes)
    return out


def _bytes(array: np.ndarray) -> memoryview:
    return memoryview(array).cast("B")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("closed")
        data += chunk
    return data

