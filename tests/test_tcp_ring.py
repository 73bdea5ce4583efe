"""The ring of TCP connections that tensor-parallel ranks on several hosts run their collectives over
(fastdeploy/distributed/tcp_ring.py), as threads of this process on loopback: every collective against numpy, the
same bits on every rank, and a rank that goes away is an error on the others at once."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import paddle
import pytest

from fastdeploy.distributed.rendezvous import RankLost
from fastdeploy.distributed.tcp_ring import RingComm


class Store:
    """The part of Paddle's TCPStore the ring uses: set, and get that waits for the key."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def get(self, key: str) -> bytes:
        with self.changed:
            assert self.changed.wait_for(lambda: key in self.values, timeout=30)
            return self.values[key]


def on_ring(size: int, work: Callable[[RingComm], object]) -> list[object]:
    """work(comm) on every rank of a fresh ring, each in a thread; their results by rank."""
    store, comms = Store(), [RingComm(rank, size) for rank in range(size)]

    def run(comm: RingComm) -> object:
        comm.connect(store, "127.0.0.1")
        try:
            return work(comm)
        finally:
            comm.close()

    with ThreadPoolExecutor(size) as pool:
        return [f.result(timeout=120) for f in [pool.submit(run, comm) for comm in comms]]


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 7), (3, 5, 11), (70_001,)])  # whole, and (over 64 KiB) chunked round the ring
def test_all_reduce_is_the_sum_with_the_same_bits_on_every_rank(size: int, shape: tuple[int, ...]) -> None:
    parts = [np.random.default_rng(rank).standard_normal(shape).astype(np.float32) for rank in range(size)]
    results = on_ring(size, lambda comm: comm.all_reduce(paddle.to_tensor(parts[comm.rank])).numpy())
    for result in results:
        assert result.dtype == np.float32 and result.shape == shape
        assert result.tobytes() == results[0].tobytes()
    np.testing.assert_allclose(results[0], np.sum(parts, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [2, 3])
def test_gather_min_and_messages(size: int) -> None:
    logits = [np.arange(12, dtype=np.float32).reshape(3, 4) + 100 * rank for rank in range(size)]
    messages = [b"", b"step", bytes(range(256)) * 20_000]  # the last one over 5 MB

    def work(comm: RingComm) -> tuple:
        gathered = comm.gather_to_first(paddle.to_tensor(logits[comm.rank])).numpy()
        smallest = comm.min_int(50 - comm.rank)
        if comm.rank == 0:
            for message in messages:
                comm.send(message)
            got = messages
        else:
            got = [comm.receive() for _ in messages]
        return gathered, smallest, got

    results = on_ring(size, work)
    np.testing.assert_array_equal(results[0][0], np.stack(logits))
    assert [r[1] for r in results] == [50 - (size - 1)] * size
    assert all(r[2] == messages for r in results)


def test_bfloat16_is_refused() -> None:
    def work(comm: RingComm) -> None:
        with pytest.raises(TypeError, match="bfloat16"):
            comm.all_reduce(paddle.zeros([2], dtype="bfloat16"))

    on_ring(2, work)


def test_a_rank_that_goes_away_fails_the_others_at_once() -> None:
    def work(comm: RingComm) -> float:
        if comm.rank == 2:
            time.sleep(0.5)
            return 0.0  # gone: its sockets close
        start = time.monotonic()
        with pytest.raises(RankLost, match="tensor-parallel all-reduce failed: another rank exited"):
            comm.all_reduce(paddle.ones([4]))
        return time.monotonic() - start

    assert max(on_ring(3, work)) < 5.0
