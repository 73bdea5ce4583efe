"""Collectives between the tensor-parallel ranks of one host, through shared memory.

Why not paddle's gloo group: it rendezvouses through paddle's TCPStore, which listens on every interface,
unauthenticated, for the group's whole life (and gloo's pairs listen on whatever address the host name
resolves to). Here rank 0 makes an anonymous memory file (memfd: it has no name anywhere) and its workers
inherit its descriptor when rank 0 starts them: no port, nothing another process can open. It is also far
faster on a CPU: a collective is a copy in, a wait on the other ranks' counters and a copy out.

The segment: a header with one 64-byte line per rank (its sequence counter, pid and the byte count of its
part in each buffer; each written only by that rank), then two buffers of `size` slots of SLOT_BYTES. Collective
number s: every rank copies its part into its slot of buffer s % 2, publishes s, waits until every counter is
>= s and copies every slot out. Buffer s % 2 is next written for collective s + 2 by a rank that has seen all
counters at s + 1, and a rank publishes s + 1 only after it has read collective s: so two buffers need one
wait per collective. Larger tensors go through in SLOT_BYTES chunks, one collective each. Ordering: x86-64
makes stores visible in program order and does not reorder loads with loads (TSO), so a counter seen at s
means that rank's part is there.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import platform
import select
import time
from collections.abc import Callable

import paddle

SLOT_BYTES = 4 << 20
_LINE = 8  # int64 words per rank's header line (64 bytes: no two ranks write one cache line)
_COUNTER, _PID, _NBYTES = 0, 1, 2  # words of a rank's line (_NBYTES: two, one per buffer)
_SPIN_S = 50e-6  # a wait spins this long (the other ranks are usually microseconds behind), then yields
_CHECK_S = 0.01  # a longer wait checks this often whether a rank it waits for has exited
TIMEOUT_S = 600.0  # a collective some rank never reaches fails after this long


def segment_bytes(size: int) -> int:
    return _header_bytes(size) + 2 * size * SLOT_BYTES


def _header_bytes(size: int) -> int:
    return mmap.PAGESIZE * math.ceil(size * _LINE * 8 / mmap.PAGESIZE)


def create_segment(size: int) -> int:
    """The file descriptor of a new zeroed segment for `size` ranks (closed on exec: pass it to the workers
    with Popen's pass_fds)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise NotImplementedError("tensor parallel's shared-memory collectives rely on x86-64's memory ordering")
    fd = os.memfd_create("fastdeploy-tp", os.MFD_CLOEXEC)
    os.ftruncate(fd, segment_bytes(size))
    return fd


class ShmComm:
    """One rank's end of the segment. Every rank must make the same collectives with the same shapes, in
    the same order (a different byte count is a RuntimeError, not a wrong result)."""

    def __init__(self, fd: int, rank: int, size: int):
        self._peers: dict[int, int] = {}  # rank -> pidfd, to notice a rank that exited while we wait for it
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in [0, {size})")
        self.rank, self.size = rank, size
        self._map = mmap.mmap(fd, segment_bytes(size))  # shared; the mapping outlives the descriptor
        self._header = (ctypes.c_int64 * (size * _LINE)).from_buffer(self._map)
        self._buffers = ctypes.addressof(self._header) + _header_bytes(size)
        self._seq = 0

    def join(self, check: Callable[[], None] | None = None) -> None:
        """Wait until every rank has mapped the segment (the first collective), calling `check` now and then
        (it raises to give up); from then on watch their processes."""
        self._line(self.rank)[_PID] = os.getpid()
        self._publish(0, check)
        self._peers = {q: os.pidfd_open(self._line(q)[_PID]) for q in range(self.size) if q != self.rank}

    def __del__(self) -> None:
        for fd in self._peers.values():
            os.close(fd)

    def gather(self, x: paddle.Tensor) -> paddle.Tensor:
        """[size, *x.shape]: every rank's x, in rank order."""
        x = x.contiguous()
        if not x.place.is_cpu_place():
            raise ValueError(f"tensor-parallel collectives take CPU tensors, got one on {x.place}")
        nbytes = math.prod(x.shape) * x.element_size()
        out = paddle.empty([self.size, *x.shape], dtype=x.dtype)
        src, dst = x.data_ptr(), out.data_ptr()
        for start in range(0, nbytes, SLOT_BYTES):
            n = min(SLOT_BYTES, nbytes - start)
            buffer = self._buffers + ((self._seq + 1) % 2) * self.size * SLOT_BYTES
            ctypes.memmove(buffer + self.rank * SLOT_BYTES, src + start, n)
            self._publish(n)
            for q in range(self.size):
                ctypes.memmove(dst + q * nbytes + start, buffer + q * SLOT_BYTES, n)
        return out

    def all_reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """The ranks' sum: every rank adds the same parts in the same order, so all hold the same bits."""
        return self.gather(x).sum(axis=0)

    gather_to_first = gather  # every rank gets the parts; copying them out is cheap here

    def _line(self, rank: int) -> ctypes.Array:
        return (ctypes.c_int64 * _LINE).from_address(ctypes.addressof(self._header) + rank * _LINE * 8)

    def _publish(self, nbytes: int, check: Callable[[], None] | None = None) -> None:
        """Publish the next collective with this rank's part of `nbytes`, and wait until every rank has."""
        self._seq += 1
        seq, header = self._seq, self._header
        size_word = _NBYTES + seq % 2  # a rank already at seq + 1 writes the other one
        header[self.rank * _LINE + size_word] = nbytes
        header[self.rank * _LINE + _COUNTER] = seq  # last: it says the part and its size are there
        behind = [q for q in range(self.size) if header[q * _LINE + _COUNTER] < seq]
        if behind:
            self._wait(seq, behind, check)
        sizes = {header[q * _LINE + size_word] for q in range(self.size)}
        if len(sizes) > 1:
            raise RuntimeError(f"tensor-parallel collective {seq}: the ranks sent parts of different sizes {sizes}")

    def _wait(self, seq: int, behind: list[int], check: Callable[[], None] | None) -> None:
        header = self._header
        start = checked = time.monotonic()
        while behind:
            behind = [q for q in behind if header[q * _LINE + _COUNTER] < seq]
            now = time.monotonic()
            if now - start < _SPIN_S:
                continue
            os.sched_yield()  # let other work on this core run (time.sleep(0) would take ~80 us)
            if now - checked >= _CHECK_S and behind:
                checked = now
                if check is not None:
                    check()
                self._check(seq, behind, now - start)

    def _check(self, seq: int, behind: list[int], waited: float) -> None:
        peers = [self._peers[q] for q in behind if q in self._peers]
        exited = select.select(peers, [], [], 0)[0] if peers else []
        if exited:
            ranks = [q for q in behind if self._peers.get(q) in exited]
            raise RuntimeError(f"tensor-parallel rank(s) {ranks} exited before collective {seq}")
        if waited > TIMEOUT_S:
            raise RuntimeError(f"tensor-parallel rank(s) {behind} did not reach collective {seq} in {TIMEOUT_S:g} s")
