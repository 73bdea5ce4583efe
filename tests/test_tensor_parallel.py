"""Tensor parallel on CPU: rank 0 in this process, the other ranks in worker processes, shared-memory
collectives.

- tensor_parallel_size=2 reproduces transformers' greedy tokens (committed references) and gives the
  same tokens as tensor_parallel_size=1, with logprobs within 1e-4, in a batch that is prefilled in
  chunks and preempted for lack of KV blocks; for ERNIE-4.5 dense (both layouts, and with biases),
  ERNIE-4.5 MoE (experts split over the ranks), Qwen2 (untied LM head), Qwen3 (per-head norms) and
  Qwen3-MoE (experts split, GQA groups of 3), Llama 3 (scaled rope, GQA groups of 3) and Mistral (one KV
  head, replicated);
  4 ranks (KV heads replicated) as well.
- Each rank's parameters are its slices of the full model, and loading converts only those slices.
- Workers go away with the LLM object, with their parent process, and survive nothing; Ctrl-C on
  rank 0 leaves the ranks in step.
- No rank listens on anything but loopback (issue 41, point 8).
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import FIXTURES, REFERENCE
from fastdeploy import LLM, SamplingParams
from fastdeploy.distributed.parallel_state import TPGroup
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor import load as load_module
from fastdeploy.model_executor.load import Checkpoint, load_model
from fastdeploy.model_executor.weight_format import named_weights

MODELS = FIXTURES / "models"
REFS = {name: json.loads((REFERENCE / name).read_text())
        for name in ("ernie45_tiny_greedy.json", "ernie45_moe_tiny_greedy.json", "qwen2_tiny_greedy.json",
                     "qwen3_tiny_greedy.json", "qwen3_moe_tiny_greedy.json", "llama3_tiny_greedy.json",
                     "mistral_tiny_greedy.json")}
FAMILIES = {  # fixture -> reference
    "ernie45_tiny_hf": "ernie45_tiny_greedy.json",
    "ernie45_tiny_paddle": "ernie45_tiny_greedy.json",
    "ernie45_moe_tiny_hf": "ernie45_moe_tiny_greedy.json",
    "ernie45_moe_tiny_paddle": "ernie45_moe_tiny_greedy.json",
    "qwen2_tiny": "qwen2_tiny_greedy.json",
    "qwen3_tiny": "qwen3_tiny_greedy.json",
    "qwen3_moe_tiny": "qwen3_moe_tiny_greedy.json",
    "llama3_tiny": "llama3_tiny_greedy.json",  # KV heads split, llama3 rope scaling
    "mistral_tiny": "mistral_tiny_greedy.json",  # one KV head, replicated
}
# Small budget and pool: long prompts are prefilled in chunks and requests get preempted.
ENGINE = dict(block_size=16, max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=32,
              num_gpu_blocks_override=14, enable_prefix_caching=False, dtype="float32")  # vs transformers float32
LOGPROB_TOL = 1e-4  # tensor parallel vs one rank (only the summation order differs)
REF_TOL = 1e-3  # vs transformers


def prompts_for(ref: dict) -> list[list[int]]:
    rng = np.random.default_rng(7)
    extra = [rng.integers(3, 1000, size=int(n)).tolist() for n in (70, 5, 45, 90)]
    return [c["prompt_token_ids"] for c in ref["cases"]] + extra


def generate(llm: LLM, ref: dict) -> list:
    params = SamplingParams(temperature=0, max_tokens=ref["max_new_tokens"], ignore_eos=True, logprobs=ref["top_k"])
    return llm.generate([{"prompt_token_ids": p} for p in prompts_for(ref)], params, use_tqdm=False)


def assert_same_outputs(tp_outputs: list, single_outputs: list) -> None:
    for got, want in zip(tp_outputs, single_outputs, strict=True):
        assert got.outputs.token_ids == want.outputs.token_ids
        for got_step, want_step in zip(got.outputs.logprobs, want.outputs.logprobs, strict=True):
            assert set(got_step) == set(want_step)
            for token, entry in want_step.items():
                assert got_step[token].logprob == pytest.approx(entry.logprob, abs=LOGPROB_TOL)


def assert_matches_reference(outputs: list, cases: list[dict]) -> None:
    for out, case in zip(outputs, cases):  # the reference cases come first
        assert out.outputs.token_ids == case["output_token_ids"]
        for step, got in zip(case["steps"], out.outputs.logprobs, strict=True):
            for token, logprob in step["top5"]:
                assert got[token].logprob == pytest.approx(logprob, abs=REF_TOL)


@pytest.fixture(scope="module", params=list(FAMILIES))
def runs(request: pytest.FixtureRequest) -> tuple[dict, list, list, LLM]:
    ref = REFS[FAMILIES[request.param]]
    path = str(MODELS / request.param)
    single = generate(LLM(model=path, **ENGINE), ref)
    llm = LLM(model=path, tensor_parallel_size=2, **ENGINE)
    return ref, generate(llm, ref), single, llm


def test_two_ranks_match_one_rank_and_transformers(runs: tuple[dict, list, list, LLM]) -> None:
    ref, tp_outputs, single, llm = runs
    assert llm.engine.scheduler.num_preemptions > 0  # the batch really was preempted
    assert len(llm.engine.runner.worker_pids) == 1
    assert_same_outputs(tp_outputs, single)
    assert_matches_reference(tp_outputs, ref["cases"])


def test_worker_holds_the_other_shard(runs: tuple[dict, list, list, LLM]) -> None:
    """What rank 1 loaded in its own process is exactly rank 1's slices of the checkpoint."""
    ref, _, _, llm = runs
    config = llm.config.model_config
    (worker,) = llm.engine.runner.worker_parameters()
    expected = named_weights(load_model(config, TPGroup(1, 2)))
    assert sorted(worker) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(worker[name], value, err_msg=name)
    mine = named_weights(llm.engine.runner.model)
    rank0 = named_weights(load_model(config, TPGroup(0, 2)))
    assert sorted(mine) == sorted(rank0)
    for name, value in rank0.items():
        np.testing.assert_array_equal(mine[name], value, err_msg=name)


def write_bias_variant(out: Path) -> Path:
    """The dense HF fixture with use_bias and transformers' recorded biases (reference `bias_variant`)."""
    source = MODELS / "ernie45_tiny_hf"
    variant = REFS["ernie45_tiny_greedy.json"]["bias_variant"]
    out.mkdir()
    for name in os.listdir(source):
        if not name.endswith(".safetensors"):
            (out / name).write_bytes((source / name).read_bytes())
    config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "use_bias": True}))
    with Checkpoint(str(source)) as ckpt:
        tensors = {n: ckpt.read(n) for n in ckpt.tensors}
    biases = {n: np.asarray(v, np.float32) for n, v in variant["biases"].items()}
    save_file({**tensors, **biases}, str(out / "model.safetensors"))
    return out


def test_biases_and_four_ranks_with_replicated_kv_heads(tmp_path: Path) -> None:
    """Row-parallel biases are added once; with 4 ranks and 2 KV heads each KV head lives on 2 ranks."""
    ref = REFS["ernie45_tiny_greedy.json"]
    cases = ref["bias_variant"]["cases"]
    path = str(write_bias_variant(tmp_path / "bias"))
    params = SamplingParams(temperature=0, max_tokens=len(cases[0]["steps"]), ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": c["prompt_token_ids"]} for c in cases]
    for size in (2, 4):
        llm = LLM(model=path, tensor_parallel_size=size, **ENGINE)
        assert len(llm.engine.runner.worker_pids) == size - 1
        assert_matches_reference(llm.generate(prompts, params, use_tqdm=False), cases)
        if size == 4:
            assert llm.engine.runner.kv_caches[0].shape[2] == 1  # one KV head per rank
        del llm


@pytest.mark.parametrize("fixture, size", [("ernie45_tiny_hf", 2), ("ernie45_tiny_paddle", 4),
                                           ("ernie45_moe_tiny_hf", 2), ("qwen2_tiny", 2), ("qwen3_moe_tiny", 2)])
def test_each_rank_loads_only_its_slices(monkeypatch: pytest.MonkeyPatch, fixture: str, size: int) -> None:
    """Shards have the expected shapes, together make up the full parameters, and loading one
    converts exactly that rank's elements from the file (never a whole sharded tensor)."""
    config = ModelConfig.from_pretrained(MODELS / fixture)
    full = named_weights(load_model(config))
    converted: list[int] = []
    original, original_packable = load_module.LazyArray.__array__, load_module.LazyArray.packable

    def counting(self, dtype=None, copy=None):
        converted.append(self.size)
        return original(self, dtype, copy)

    def counting_packable(self):
        converted.append(self.size)
        return original_packable(self)

    monkeypatch.setattr(load_module.LazyArray, "__array__", counting)
    monkeypatch.setattr(load_module.LazyArray, "packable", counting_packable)
    shards = []
    for rank in range(size):
        converted.clear()
        model = load_model(config, TPGroup(rank, size))
        shards.append(named_weights(model))
        assert sum(converted) == sum(v.size for v in shards[-1].values())
    monkeypatch.undo()

    heads, kv_heads, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    local_kv = max(kv_heads // size, 1)
    q = shards[0]["model.layers.0.self_attn.qkv_proj.weight"]
    assert q.shape == (config.hidden_size, (heads // size + 2 * local_kv) * d)
    assert shards[0]["model.layers.0.self_attn.o_proj.weight"].shape == (heads // size * d, config.hidden_size)
    assert shards[0]["model.embed_tokens.weight"].shape == (config.vocab_size // size, config.hidden_size)
    for name, value in full.items():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            parts = np.split(value, np.cumsum([heads * d, kv_heads * d]), axis=-1)
            for rank, shard in enumerate(shards):
                kv = rank * kv_heads // size
                want = np.concatenate([np.split(parts[0], size, axis=-1)[rank]]
                                      + [p[..., kv * d:(kv + local_kv) * d] for p in parts[1:]], axis=-1)
                np.testing.assert_array_equal(shard[name], want, err_msg=f"{name} rank {rank}")
        elif ".experts." in name:
            owners = [s[name] for s in shards if name in s]
            assert len(owners) == 1, name  # each expert lives on exactly one rank, whole
            np.testing.assert_array_equal(owners[0], value, err_msg=name)
        elif name.endswith("up_gate_proj.weight"):
            halves = [np.split(h, size, axis=-1) for h in np.split(value, 2, axis=-1)]
            for rank, shard in enumerate(shards):
                want = np.concatenate([halves[0][rank], halves[1][rank]], axis=-1)
                np.testing.assert_array_equal(shard[name], want, err_msg=name)
        elif shards[0][name].shape == value.shape:  # replicated: norms, router, correction bias
            for shard in shards:
                np.testing.assert_array_equal(shard[name], value, err_msg=name)
        else:  # row-parallel weights and vocab shards: split along the one axis that differs
            axis = [a for a, (s, f) in enumerate(zip(shards[0][name].shape, value.shape)) if s != f]
            assert len(axis) == 1, name
            np.testing.assert_array_equal(np.concatenate([s[name] for s in shards], axis=axis[0]), value,
                                          err_msg=name)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_workers_end_with_the_llm_object_and_a_new_llm_works(tiny_hf: str) -> None:
    ref = REFS["ernie45_tiny_greedy.json"]
    case = ref["cases"][0]
    params = SamplingParams(temperature=0, max_tokens=len(case["output_token_ids"]), ignore_eos=True)
    for _ in range(2):
        llm = LLM(model=tiny_hf, tensor_parallel_size=2, block_size=16, dtype="float32")  # transformers' tokens
        pids = llm.engine.runner.worker_pids
        assert pids and all(alive(p) for p in pids)
        assert all(os.getsid(p) != os.getsid(0) for p in pids)  # own session: no terminal Ctrl-C
        out = llm.generate([{"prompt_token_ids": case["prompt_token_ids"]}], params, use_tqdm=False)
        assert out[0].outputs.token_ids == case["output_token_ids"]
        del llm, out
        gc.collect()
        assert wait_gone(pids, timeout_s=0.5) == []  # already stopped and reaped by the finalizer


def test_workers_exit_when_their_parent_is_killed(tmp_path: Path, tiny_hf: str) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, signal, sys\n"
        "from fastdeploy import LLM\n"
        f"llm = LLM(model={tiny_hf!r}, tensor_parallel_size=2, block_size=16)\n"
        "print(*llm.engine.runner.worker_pids, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    root = Path(__file__).parent.parent
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    assert wait_gone(pids) == []


def test_ctrl_c_waits_for_the_step_and_leaves_ranks_in_step(tiny_hf: str) -> None:
    ref = REFS["ernie45_tiny_greedy.json"]
    llm = LLM(model=tiny_hf, tensor_parallel_size=2, block_size=16, max_num_seqs=4, dtype="float32")
    long = SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True)
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in ref["cases"][:4]], long, use_tqdm=False)
    finally:
        timer.cancel()
    pids = llm.engine.runner.worker_pids
    assert pids and all(alive(p) for p in pids)
    params = SamplingParams(temperature=0, max_tokens=ref["max_new_tokens"], ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in ref["cases"]], params,
                           use_tqdm=False)
    assert [o.outputs.token_ids for o in outputs] == [c["output_token_ids"] for c in ref["cases"]]


@pytest.mark.parametrize("fixture, size, named", [
    ("ernie45_tiny_hf", 3, "num_attention_heads"),
    ("ernie45_moe_tiny_hf", 4, "moe_num_experts"),
    ("ernie45_tiny_hf", 0, "tensor_parallel_size"),
])
def test_bad_tensor_parallel_size(fixture: str, size: int, named: str) -> None:
    with pytest.raises(ValueError, match=named) as info:
        LLM(model=str(MODELS / fixture), tensor_parallel_size=size)
    assert "tensor_parallel_size" in str(info.value)


def listening_addresses(pid: int) -> set[str]:
    """'address:port' (hex, as /proc/net/tcp writes them) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # state LISTEN
                found.add(fields[1])
    return found


def is_loopback(address: str) -> bool:
    host = address.split(":")[0]
    return host == "0100007F" or host == "00000000000000000000000001000000"  # 127.0.0.1, ::1


def test_no_rank_listens_beyond_loopback(tiny_hf: str) -> None:
    before = listening_addresses(os.getpid())
    llm = LLM(model=tiny_hf, tensor_parallel_size=2, block_size=16)
    assert llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs.token_ids
    ranks = [os.getpid(), *llm.engine.runner.worker_pids]
    opened = {pid: listening_addresses(pid) - (before if pid == os.getpid() else set()) for pid in ranks}
    assert {pid: [a for a in found if not is_loopback(a)] for pid, found in opened.items()} == \
        {pid: [] for pid in ranks}
