"""Tensor parallel's shared-memory collectives (fastdeploy/distributed/shm_comm.py) between this process
(rank 0) and a real second process (rank 1) that inherits the segment, as a worker does: each rank's part
comes from a generator both sides can rebuild, so rank 0 checks every byte of the gathered result."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import paddle
import pytest

from fastdeploy.distributed.shm_comm import SLOT_BYTES, ShmComm, create_segment

ROOT = Path(__file__).resolve().parent.parent

# (shape, dtype) of each collective, in order: chunk remainders, several chunks, bf16, ints, no bytes at all.
PLAN = [([3, 5], "float32"), ([SLOT_BYTES // 4 * 2 + 7], "float32"), ([1, 4097], "bfloat16"), ([64], "int64"),
        ([0, 8], "float32"), ([2, SLOT_BYTES // 2 + 3], "bfloat16")]

PARTNER = """
import os, sys, json
sys.path.insert(0, {root!r})
import numpy as np, paddle
from tests.test_shm_comm import part, PLAN
from fastdeploy.distributed.shm_comm import ShmComm
fd, mode = int(sys.argv[1]), sys.argv[2]
comm = ShmComm(fd, 1, 2)
os.close(fd)
comm.join()
if mode == "exit":
    os._exit(0)
plan = PLAN if mode == "plan" else [([4], "float32")]
try:
    for shape, dtype in plan:
        comm.gather(part(1, shape, dtype))
except RuntimeError as e:
    print("error:", e, flush=True)
    sys.exit(3)
"""


def part(rank: int, shape: list[int], dtype: str) -> paddle.Tensor:
    values = np.random.default_rng([rank, *shape]).standard_normal(shape) * 100
    return paddle.to_tensor(values.astype("int64") if dtype == "int64" else values.astype("float32")).astype(dtype)


def start_partner(mode: str) -> tuple[ShmComm, subprocess.Popen]:
    fd = create_segment(2)
    proc = subprocess.Popen([sys.executable, "-c", PARTNER.format(root=str(ROOT)), str(fd), mode], pass_fds=(fd,),
                            stdout=subprocess.PIPE, text=True)
    comm = ShmComm(fd, 0, 2)
    os.close(fd)
    comm.join(check=lambda: proc.poll() is None or pytest.fail(f"the partner exited with {proc.returncode}"))
    return comm, proc


def test_gather_returns_every_rank_part_bit_for_bit() -> None:
    comm, proc = start_partner("plan")
    for shape, dtype in PLAN:
        mine = part(0, shape, dtype)
        got = comm.gather(mine)
        assert got.shape == [2, *shape] and got.dtype == mine.dtype
        for rank in (0, 1):
            expected = part(rank, shape, dtype)
            assert np.array_equal(got[rank].view("int16" if dtype == "bfloat16" else dtype).numpy(),
                                  expected.view("int16" if dtype == "bfloat16" else dtype).numpy()), (shape, dtype)
    assert proc.wait(60) == 0


def test_parts_of_different_sizes_are_an_error_on_every_rank() -> None:
    comm, proc = start_partner("mismatch")
    with pytest.raises(RuntimeError, match="different sizes"):
        comm.gather(paddle.zeros([5], dtype="float32"))
    assert proc.wait(60) == 3
    assert "different sizes" in proc.stdout.read()


def test_a_rank_that_exits_fails_the_collective_waiting_for_it() -> None:
    comm, proc = start_partner("exit")
    proc.wait(60)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] exited"):
        comm.gather(paddle.zeros([4], dtype="float32"))
    assert time.monotonic() - started < 5


def test_a_rank_outside_the_group_is_refused() -> None:
    fd = create_segment(2)
    try:
        with pytest.raises(ValueError, match="rank 2"):
            ShmComm(fd, 2, 2)
    finally:
        os.close(fd)
