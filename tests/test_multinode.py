"""Tensor parallel across hosts (issue 45): two `python -m paddle.distributed.launch` invocations on loopback
act as two nodes of one launch, the ranks meeting at rank 0's store and joined by a ring of TCP connections; and
FastDeploy's ips= form runs without the launcher.

- tp=2 across the two "nodes" gives transformers' greedy tokens (committed references) and tensor_parallel_size=1's
  tokens and logprobs, for ERNIE-4.5 dense and MoE (the latter as 2 ranks on one node, PADDLE_LOCAL_SIZE=2); the
  batch is prefilled in chunks and preempted; an idle spell longer than the ring's 30 s timeout leaves the group
  working (rank 0's heartbeats); every process exits 0 when rank 0's script ends.
- Across two nodes, MTP speculation (the demo model's trained layer; drafts accepted) gives one rank's tokens
  without speculation, and ERNIE-4.5-VL's text, image and video prompts give transformers' tokens.
- Killing one node's processes mid-generation fails rank 0's generate with a WorkerError within the bound; killing
  rank 0's ends the others as quickly.
- The ring's all-reduce (whole and chunked), gather and broadcast give numpy's results, the same bits on every rank.
- Ranks started with different arguments fail naming the argument; bad launcher variables and a rank 0 on a
  host that is not the master's are clear errors; an unreachable master is an error within the store timeout.
- The step message round-trips field by field, and a corrupted or malformed one is refused.
"""
from __future__ import annotations

import json
import re
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import FIXTURES
from fastdeploy import LLM, SamplingParams
from fastdeploy.distributed import rendezvous, tcp_ring
from fastdeploy.distributed.launch import Launch, answers, is_local_address
from fastdeploy.step_types import ForwardBatch, VisionSlice
from fastdeploy.worker import messages, step_codec
from fastdeploy.worker.step_codec import MessageError
from test_tensor_parallel import ENGINE, REFS, assert_matches_reference, assert_same_outputs, generate

MODELS = FIXTURES / "models"
RUN_TIMEOUT_S = 240
KILL_BOUND_S = 10.0  # a rank whose process exits: its peers' next collective fails at once (docs/distributed.md)

SCRIPT = r'''
import json, sys, time
from fastdeploy import LLM, SamplingParams
model, out, mode, extra = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
engine = dict(block_size=16, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=32,
              num_gpu_blocks_override=14, enable_prefix_caching=False, dtype="float32")
if mode == "prompts":  # the test's own engine arguments and prompts (token ids, or VL cases built here)
    engine = {}
engine = {"tensor_parallel_size": 2, **engine, **extra}
llm = LLM(model=model, **engine)  # ranks > 0 never return from here
assert llm._check_master()
ref = json.loads(open(sys.argv[5]).read()) if len(sys.argv) > 5 else None
def outputs(results):
    return [{"ids": r.outputs.token_ids, "logprobs": [{str(t): e.logprob for t, e in step.items()}
                                                     for step in r.outputs.logprobs]} for r in results]
if mode == "generate":
    params = SamplingParams(temperature=0, max_tokens=ref["max_new_tokens"], ignore_eos=True, logprobs=ref["top_k"])
    first = llm.generate([{"prompt_token_ids": p} for p in ref["prompts"]], params, use_tqdm=False)
    time.sleep(ref["idle_s"])  # longer than the ring's timeout: the other ranks must still be there
    again = llm.generate([{"prompt_token_ids": p} for p in ref["prompts"]], params, use_tqdm=False)
    json.dump({"first": outputs(first), "again": outputs(again),
               "preemptions": llm.engine.scheduler.num_preemptions}, open(out, "w"))
elif mode == "prompts":
    sys.path.insert(0, ref["tests"])
    from test_ernie45_vl_generate import generate_prompt
    prompts = [generate_prompt(p) if isinstance(p, dict) else {"prompt_token_ids": p} for p in ref["prompts"]]
    results = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=ref["max_tokens"], ignore_eos=True),
                           use_tqdm=False)
    json.dump([{"ids": r.outputs.token_ids, "error": r.error_msg, "accepted": r.metrics.num_accepted_tokens}
               for r in results], open(out, "w"))
elif mode == "until_error":
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    try:
        for i in range(2000):  # bounded: the test kills the other node within the first few
            llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, params, use_tqdm=False)
            if i == 0:
                open(out + ".generating", "w").close()
        json.dump({"error": None}, open(out, "w"))
    except Exception as e:
        json.dump({"error": f"{type(e).__name__}: {e}", "at": time.time()}, open(out, "w"))
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, node: int, port: int, args: list[str], nnodes: int = 2, nproc: int = 1
           ) -> subprocess.Popen:
    """One node's `python -m paddle.distributed.launch`."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--master", f"127.0.0.1:{port}", "--nnodes",
           str(nnodes), "--nproc_per_node", str(nproc), "--rank", str(node), "--log_dir", str(tmp_path / f"node{node}"),
           str(script), *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def logs(tmp_path: Path, tail: int = 3000) -> str:
    """The ranks' logs (each one's last `tail` characters)."""
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-tail:]}"
                     for p in sorted(tmp_path.glob("node*/workerlog.*")))


def descendants(pid: int) -> list[int]:
    """pid and every process below it (the launcher starts each rank in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL one node: its launcher and every process it started."""
    for pid in descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(procs: list[subprocess.Popen], tmp_path: Path) -> list[int]:
    trees = [descendants(p.pid) for p in procs]
    try:
        return [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
    except subprocess.TimeoutExpired:
        raise AssertionError(f"a node did not finish within {RUN_TIMEOUT_S} s:\n{logs(tmp_path)}") from None
    finally:
        for pid in (pid for tree in trees for pid in tree):  # nothing outlives the test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def reference_run(ref: dict, tmp_path: Path, idle_s: float) -> Path:
    """The reference prompts (and tensor-parallel test's extra ones) for the launched script."""
    from test_tensor_parallel import prompts_for

    path = tmp_path / "ref.json"
    path.write_text(json.dumps({"prompts": prompts_for(ref), "max_new_tokens": ref["max_new_tokens"],
                                "top_k": ref["top_k"], "idle_s": idle_s}))
    return path


def as_outputs(result: list[dict]) -> list[SimpleNamespace]:
    """A launched run's outputs in the shape test_tensor_parallel's checks read."""
    return [SimpleNamespace(outputs=SimpleNamespace(token_ids=o["ids"], logprobs=[
        {int(t): SimpleNamespace(logprob=v) for t, v in step.items()} for step in o["logprobs"]])) for o in result]


@pytest.mark.parametrize("fixture, reference, nnodes, nproc, idle_s", [
    # two nodes of one rank each, idle between two runs for longer than the ring's timeout
    ("ernie45_tiny_hf", "ernie45_tiny_greedy.json", 2, 1, tcp_ring.TIMEOUT_S + 5),
    ("ernie45_moe_tiny_paddle", "ernie45_moe_tiny_greedy.json", 1, 2, 0),  # one node of two ranks (experts split)
])
def test_launched_ranks_match_one_rank_and_transformers(tmp_path: Path, fixture: str, reference: str, nnodes: int,
                                                         nproc: int, idle_s: float) -> None:
    ref = REFS[reference]
    model = str(MODELS / fixture)
    out = tmp_path / "out.json"
    args = [model, str(out), "generate", "{}", str(reference_run(ref, tmp_path, idle_s))]
    port = free_port()
    procs = [launch(tmp_path, node, port, args, nnodes, nproc) for node in range(nnodes)]
    codes = finish(procs, tmp_path)
    assert codes == [0] * nnodes, logs(tmp_path)
    assert out.exists(), logs(tmp_path)
    result = json.loads(out.read_text())
    assert result["preemptions"] > 0  # the batch really was preempted
    single = generate(LLM(model=model, **ENGINE), ref)
    for name in ("first", "again"):
        launched = as_outputs(result[name])
        assert_same_outputs(launched, single)
        assert_matches_reference(launched, ref["cases"])
    assert "tensor-parallel rank 1 of 2 serves rank 0's steps" in logs(tmp_path)


DEMO = Path(__file__).resolve().parents[1] / "models" / "ernie-4.5-demo"


def run_prompts(tmp_path: Path, model: Path, engine: dict, prompts: list, max_tokens: int) -> list[dict]:
    """The launched script over `prompts` on two nodes of one rank each; their outputs."""
    out, ref = tmp_path / "out.json", tmp_path / "ref.json"
    ref.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "tests": str(Path(__file__).parent)}))
    port = free_port()
    procs = [launch(tmp_path, node, port, [str(model), str(out), "prompts", json.dumps(engine), str(ref)])
             for node in range(2)]
    assert finish(procs, tmp_path) == [0, 0], logs(tmp_path)
    return json.loads(out.read_text())


def test_mtp_drafts_across_launched_ranks(tmp_path: Path) -> None:
    """ERNIE-4.5's MTP layer (the demo model's trained one) split over two nodes: its steps reach rank 1 as
    MtpStep messages, drafts are accepted, and the tokens are one rank's without speculation."""
    from test_speculative import repeating_prompts

    prompts = repeating_prompts(4, seed=5)
    engine = {"max_model_len": 256, "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    got = run_prompts(tmp_path, DEMO, engine, prompts, 24)
    want = LLM(model=str(DEMO), max_model_len=256).generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [g["ids"] for g in got] == [w.outputs.token_ids for w in want]
    assert sum(g["accepted"] for g in got) > 0


def test_vl_prompts_across_launched_ranks(tmp_path: Path) -> None:
    """ERNIE-4.5-VL over two nodes: each rank encodes the media with its own vision tower from the step's vision
    slices; text, image and video prompts give transformers' tokens."""
    from test_ernie45_vl_model import BY_NAME, VL

    cases = [BY_NAME[name] for name in ("text_only", "two_images", "image_and_video")]
    prompts = [case["input_ids"] if case["name"] == "text_only" else case for case in cases]
    got = run_prompts(tmp_path, VL, {"max_model_len": 1024}, prompts, 8)
    assert [g["ids"] for g in got] == [case["output_token_ids"][:8] for case in cases]


def test_ips_without_a_launcher(tmp_path: Path) -> None:
    """FastDeploy's form: the same command on each node with ips= and no launcher, here tp=4 as two nodes of
    two ranks (each node's first rank starts its second); the first node started on a host that holds every
    listed address is the master. Tokens and logprobs as one rank's and transformers'; every process exits 0."""
    ref = REFS["ernie45_tiny_greedy.json"]
    model = str(MODELS / "ernie45_tiny_hf")
    out, port = tmp_path / "out.json", free_port()
    extra = {"ips": "127.0.0.1,127.0.0.2", "engine_worker_queue_port": port, "tensor_parallel_size": 4}
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    args = [sys.executable, str(script), model, str(out), "generate", json.dumps(extra),
            str(reference_run(ref, tmp_path, 0))]
    nodes = []
    for node in range(2):
        log = tmp_path / f"node{node}" / "workerlog.0"
        log.parent.mkdir()
        nodes.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True))
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while node == 0 and not answers("127.0.0.1", port):  # the master's store is up
            assert nodes[0].poll() is None and time.monotonic() < deadline, logs(tmp_path)
            time.sleep(0.2)
    assert finish(nodes, tmp_path) == [0, 0], logs(tmp_path)
    result = json.loads(out.read_text())
    single = generate(LLM(model=model, **ENGINE), ref)
    assert_same_outputs(as_outputs(result["first"]), single)
    assert_matches_reference(as_outputs(result["first"]), ref["cases"])
    text = logs(tmp_path, tail=100_000)
    assert "tensor parallel: 4 ranks on 2 node(s) ['127.0.0.1', '127.0.0.2']" in text
    assert "tensor-parallel rank 3 of 4 serves rank 0's steps" in text


def start_generating(tmp_path: Path) -> tuple[Path, list[subprocess.Popen]]:
    """Two nodes generating in a loop (node 0 has rank 0); returns once rank 0 has finished a first generate."""
    out = tmp_path / "out.json"
    port = free_port()
    nodes = [launch(tmp_path, node, port, [str(MODELS / "ernie45_tiny_hf"), str(out), "until_error", "{}"])
             for node in range(2)]
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not Path(str(out) + ".generating").exists():
        if time.monotonic() > deadline or any(n.poll() is not None for n in nodes):
            finish(nodes, tmp_path)
            raise AssertionError(f"the nodes did not start generating:\n{logs(tmp_path)}")
        time.sleep(0.1)
    return out, nodes


def test_killing_a_node_fails_rank_0_within_the_bound(tmp_path: Path) -> None:
    out, nodes = start_generating(tmp_path)
    killed_at = time.time()
    kill_node(nodes[1])
    codes = finish(nodes, tmp_path)
    result = json.loads(out.read_text())
    assert result["error"] is not None and result["error"].startswith("WorkerError"), result
    # whichever collective was under way when it died: the step's broadcast, an all-reduce or the logits' gather
    assert re.search(r"tensor-parallel (broadcast|all-reduce|gather) failed: another rank exited", result["error"])
    assert result["at"] - killed_at < KILL_BOUND_S
    assert codes[0] == 0  # rank 0's script caught the error and ended normally


def test_killing_rank_0_ends_the_other_ranks_within_the_bound(tmp_path: Path) -> None:
    _, nodes = start_generating(tmp_path)
    kill_node(nodes[0])
    start = time.monotonic()
    other = nodes[1]
    try:
        other.wait(timeout=KILL_BOUND_S)
    finally:
        finish(nodes, tmp_path)
    assert other.returncode != 0
    assert time.monotonic() - start < KILL_BOUND_S
    assert "tensor-parallel rank 1 stops after an error" in logs(tmp_path, tail=100_000)


def test_ranks_with_different_arguments_fail_naming_the_argument(tmp_path: Path) -> None:
    model = str(MODELS / "ernie45_tiny_hf")
    out = tmp_path / "out.json"
    port = free_port()
    procs = [launch(tmp_path, node, port, [model, str(out), "generate", json.dumps({"max_model_len": 256 + node})])
             for node in range(2)]
    codes = finish(procs, tmp_path)
    assert codes[0] != 0 and codes[1] != 0
    text = logs(tmp_path, tail=100_000)
    assert "rank 1 differs from rank 0 in max_model_len: '257' here, '256' on rank 0" in text
    assert not out.exists()


LAUNCHER_ENV = {"PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ID": "1", "PADDLE_LOCAL_RANK": "0",
                "PADDLE_LOCAL_SIZE": "1", "PADDLE_MASTER": "127.0.0.1:6170",
                "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:6171,127.0.0.2:6172"}


def test_launcher_variables() -> None:
    assert Launch.from_environ({}) is None
    assert Launch.from_environ({"PADDLE_TRAINERS_NUM": "1", "PADDLE_TRAINER_ID": "0"}) is None  # one process
    got = Launch.from_environ(LAUNCHER_ENV)
    assert (got.rank, got.world_size, got.local_size, got.master_host, got.master_port) == (1, 2, 1, "127.0.0.1", 6170)
    assert got.nodes == ["127.0.0.1", "127.0.0.2"]
    for name, value, named in [("PADDLE_TRAINER_ID", "2", "PADDLE_TRAINER_ID=2 is outside [0, 1]"),
                               ("PADDLE_TRAINERS_NUM", "x", "PADDLE_TRAINERS_NUM must be an integer"),
                               ("PADDLE_MASTER", "nohost", "PADDLE_MASTER must be HOST:PORT"),
                               ("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:1", "lists 1 endpoints")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            Launch.from_environ({**LAUNCHER_ENV, name: value})


def test_rank_0_on_a_host_that_is_not_the_master() -> None:
    """A node whose launcher could not tell its own address from --ips also takes rank 0."""
    assert is_local_address("127.0.0.1") and not is_local_address("192.0.2.1")  # TEST-NET-1: nobody's
    launch_ = Launch.from_environ({**LAUNCHER_ENV, "PADDLE_TRAINER_ID": "0", "PADDLE_MASTER": "192.0.2.1:6170"})
    with pytest.raises(ValueError, match="two nodes took rank 0.*--host <its own address>"):
        launch_.check_rank_zero_here()


def test_an_unreachable_master_is_an_error_within_the_store_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rendezvous, "STORE_TIMEOUT_S", 1)
    launch_ = Launch.from_environ({**LAUNCHER_ENV, "PADDLE_MASTER": f"127.0.0.1:{free_port()}"})
    start = time.monotonic()
    with pytest.raises(rendezvous.RankLost, match="could not reach the master 127.0.0.1:.*--master"):
        rendezvous.Rendezvous(launch_, {})
    assert time.monotonic() - start < 10


def test_tensor_parallel_size_and_ips_against_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    model = str(MODELS / "ernie45_tiny_hf")
    for name, value in LAUNCHER_ENV.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="tensor_parallel_size=1, but paddle.distributed.launch started 2 processes"):
        LLM(model=model)
    with pytest.raises(ValueError, match="ips=10.0.0.1,10.0.0.2 but paddle.distributed.launch placed the ranks on "
                                         "127.0.0.1,127.0.0.2"):
        LLM(model=model, tensor_parallel_size=2, ips="10.0.0.1,10.0.0.2")


def test_ips_without_a_launcher_finds_this_node() -> None:
    port = free_port()
    here = Launch.from_ips(["127.0.0.1", "10.255.255.1"], 4, port)  # only the first is this host's
    assert (here.rank, here.world_size, here.local_rank, here.local_size, here.starts_node_ranks) == (0, 4, 0, 2, True)
    assert here.endpoints == tuple(f"{ip}:{port}" for ip in ["127.0.0.1"] * 2 + ["10.255.255.1"] * 2)
    assert Launch.from_ips(["10.255.255.1", "127.0.0.1"], 2, port).rank == 1  # a node that is not the master
    assert Launch.from_ips(["127.0.0.1", "127.0.0.2"], 2, port).rank == 0  # one host: nothing answers, the master
    with socket.socket() as store:  # ... and once the master's port answers, the other node
        store.bind(("127.0.0.1", port))
        store.listen()
        assert Launch.from_ips(["127.0.0.1", "127.0.0.2"], 2, port).rank == 1
        with pytest.raises(ValueError, match="lists 3 addresses of this host"):
            Launch.from_ips(["127.0.0.1", "127.0.0.2", "127.0.0.3"], 3, port)
    with pytest.raises(ValueError, match="none of ips=10.255.255.1,10.255.255.2 is an address of this host"):
        Launch.from_ips(["10.255.255.1", "10.255.255.2"], 2, port)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not split evenly over the 2 nodes"):
        Launch.from_ips(["127.0.0.1", "10.255.255.1"], 3, port)
    with pytest.raises(ValueError, match="lists a node twice"):
        Launch.from_ips(["127.0.0.1", "127.0.0.1"], 2, port)
    model = str(MODELS / "ernie45_tiny_hf")
    with pytest.raises(ValueError, match="ips=10.255.255.1 names one node, and it is not this host"):
        LLM(model=model, ips="10.255.255.1")
    with pytest.raises(ValueError, match="must be comma-separated node addresses"):
        LLM(model=model, ips=" , ")
    assert LLM(model=model, ips="127.0.0.1", max_model_len=64).engine.config.launch is None  # one node: this one


def full_batch() -> ForwardBatch:
    rng = np.random.default_rng(0)
    vision = [VisionSlice("req-1", rng.standard_normal((8, 588)).astype(np.float32), [(1, 2, 4)],
                          np.arange(2, dtype=np.int64), 0, 2)]
    return ForwardBatch(np.arange(5, dtype=np.int64), np.arange(15, dtype=np.int64).reshape(3, 5),
                        np.array([3, 2]), np.array([9, 4]), np.array([[3, 4], [7, 0]]), np.array([2, 4]),
                        np.array([0, 1, 1, 0, 0]), vision, np.array([0, 1, 2]))


def assert_same(got: object, want: object) -> None:
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    elif isinstance(want, list) and want and dataclasses_like(want[0]):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    elif dataclasses_like(want):
        assert type(got) is type(want)
        for name in want.__slots__:
            assert_same(getattr(got, name), getattr(want, name))
    else:
        assert got == want


def dataclasses_like(value: object) -> bool:
    return hasattr(value, "__dataclass_fields__")


@pytest.mark.parametrize("message", [
    messages.Step(full_batch()),
    messages.Step(ForwardBatch(np.array([1]), np.array([7]), np.array([1]), np.array([8]), np.zeros((1, 4), np.int64),
                               np.array([0]))),
    messages.MtpStep(messages.MtpLayerStep([4, 5], [7, 8], [2], [9], np.array([[1, 2]]), True, [0, 1], [1])),
    messages.Stop(), messages.Noop()])
def test_step_message_round_trips(message: object) -> None:
    assert_same(step_codec.decode(step_codec.encode(message)), message)


def test_bad_step_messages_are_refused() -> None:
    good = step_codec.encode(messages.Step(full_batch()))
    header = struct.calcsize("<4sHHII")
    flipped = bytearray(good)
    flipped[header + 40] ^= 0x10
    with pytest.raises(MessageError, match="checksum"):
        step_codec.decode(bytes(flipped))
    with pytest.raises(MessageError, match="checksum"):
        step_codec.decode(good[:-3])
    with pytest.raises(MessageError, match="shorter than its header"):
        step_codec.decode(good[:5])
    with pytest.raises(MessageError, match="same fastdeploy"):
        step_codec.decode(b"XXXX" + good[4:])

    def resealed(payload: bytes, kind: int = 1) -> bytes:  # a well-formed frame around a payload
        return struct.pack("<4sHHII", b"FDTP", step_codec.VERSION, kind, len(payload), zlib.crc32(payload)) + payload

    payload = good[header:]
    with pytest.raises(MessageError, match="bytes after its last field"):
        step_codec.decode(resealed(payload + b"\0"))
    with pytest.raises(MessageError, match="unknown kind 9"):
        step_codec.decode(resealed(payload, kind=9))
    float_ids = bytes([2, 1]) + struct.pack("<I", 5) + np.zeros(5, np.float32).tobytes()  # token ids as float32
    with pytest.raises(MessageError, match="dtype code 2"):
        step_codec.decode(resealed(float_ids + payload[2 + 4 + 40:]))
    huge = bytes([1, 2]) + struct.pack("<2I", 2**32 - 1, 2**32 - 1) + bytes(16)  # positions claiming 2**64 ids
    with pytest.raises(MessageError, match="runs past its end"):
        step_codec.decode(resealed(payload[:2 + 4 + 40] + huge))
    bad = full_batch()
    bad.query_lens = np.array([3, 3])  # 6 tokens claimed, 5 sent
    with pytest.raises(MessageError, match="disagree"):
        step_codec.decode(step_codec.encode(messages.Step(bad)))
    with pytest.raises(TypeError, match="no wire form for Init"):
        step_codec.encode(messages.Init(None))


def test_fastdeploy_serve_under_the_launcher(tmp_path: Path) -> None:
    """`fastdeploy serve` as the launched script: rank 0 serves the API, rank 1 its steps; SIGTERM to the
    launcher (which then exits with that signal's number) stops the server gracefully and every rank with it."""
    import httpx
    import openai

    model = str(MODELS / "ernie45_tiny_hf")
    port, api = free_port(), free_port()
    cli = Path(sys.executable).with_name("fastdeploy")
    node = subprocess.Popen([sys.executable, "-m", "paddle.distributed.launch", "--master", f"127.0.0.1:{port}",
                             "--nnodes", "1", "--nproc_per_node", "2", "--log_dir", str(tmp_path / "node0"), str(cli),
                             "serve", model, "--tensor-parallel-size", "2", "--host", "127.0.0.1", "--port", str(api),
                             "--block-size", "16"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            assert node.poll() is None and time.monotonic() < deadline, logs(tmp_path)
            try:
                if httpx.get(f"http://127.0.0.1:{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key="x", timeout=60, max_retries=0)
        got = client.completions.create(model=model, prompt=[9, 8, 7], temperature=0, max_tokens=12,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        want = LLM(model=model, block_size=16).generate([[9, 8, 7]], SamplingParams(temperature=0, max_tokens=12,
                                                                                    ignore_eos=True), use_tqdm=False)
        assert got.choices[0].completion_token_ids == want[0].outputs.token_ids
        tree = descendants(node.pid)
        node.send_signal(signal.SIGTERM)
        node.wait(60)
        text = logs(tmp_path, tail=100_000)
        assert "server stopped" in text and "tensor-parallel rank 1 of 2 serves rank 0's steps" in text
        time.sleep(1)
        assert not [pid for pid in tree if Path(f"/proc/{pid}").exists()
                    and "zombie" not in Path(f"/proc/{pid}/status").read_text()]
    finally:
        finish([node], tmp_path)
