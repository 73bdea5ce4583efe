"""Data-parallel batch inference on Ray Data (fastdeploy.integrations.ray): a local Ray with 2 CPUs, two replicas
of a tiny model; every row comes out once with the tokens of one plain LLM run, also when a replica is killed while
it works; a replica's compiled ops take the cores Ray gave it."""
from __future__ import annotations

import os
import signal

import numpy as np
import psutil
import pytest
import ray

from fastdeploy import LLM, SamplingParams, ops
from fastdeploy.integrations.ray import LLMPredictor
from tests.conftest import FIXTURES

MODEL = str(FIXTURES / "models" / "ernie45_tiny_hf")
SAMPLING = {"temperature": 0, "max_tokens": 48, "ignore_eos": True}
PROMPTS = [f"Row {i}: " + " ".join(f"w{(i * 7 + j) % 31}" for j in range(i % 9 + 3)) for i in range(48)]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def expected() -> dict[str, list[int]]:
    outputs = LLM(model=MODEL, max_model_len=256).generate(PROMPTS, SamplingParams(**SAMPLING), use_tqdm=False)
    return {p: o.outputs.token_ids for p, o in zip(PROMPTS, outputs)}


def mapped(rows: int, **extra):
    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(PROMPTS[:rows])])
    return ds.map_batches(LLMPredictor, fn_constructor_kwargs={"model": MODEL, "sampling_params": SAMPLING,
                                                               "llm_kwargs": {"max_model_len": 256}},
                          compute=ray.data.ActorPoolStrategy(size=2), batch_size=2, num_cpus=1, **extra)


def check_every_row_once(rows: list[dict], expected: dict[str, list[int]], count: int) -> None:
    assert sorted(int(r["id"]) for r in rows) == list(range(count))
    for r in rows:
        assert r["error_code"] == 200 and r["error_msg"] == ""
        assert list(r["generated_token_ids"]) == expected[r["prompt"]], r["prompt"]
        assert isinstance(r["generated_text"], str) and r["generated_text"]


def test_two_replicas_give_every_row_once_with_one_llms_tokens(local_ray, expected) -> None:
    check_every_row_once(mapped(24).take_all(), expected, 24)


def test_a_replica_killed_mid_run_still_gives_every_row_once(local_ray, expected) -> None:
    stream = iter(mapped(48, max_restarts=2, max_task_retries=2).iter_rows())
    rows, killed = [next(stream)], []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if "LLMPredictor" in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(proc.pid)
            break
    rows += list(stream)
    assert killed, "no replica process found to kill"
    check_every_row_once(rows, expected, 48)


def test_a_replica_takes_the_cores_ray_gives_it(local_ray) -> None:
    actor = ray.remote(num_cpus=1)(LLMPredictor).remote(MODEL, SAMPLING, {"max_model_len": 256})
    assert ray.get(actor.__ray_call__.remote(lambda predictor: ops.runtime_info()["num_threads"])) == 1
    ray.kill(actor)


def test_rows_keep_their_columns_and_a_refused_prompt_fails_its_row_alone() -> None:
    predictor = LLMPredictor(MODEL, SAMPLING, {"max_model_len": 64})
    batch = {"id": np.array([0, 1, 2]), "prompt": np.array(["short", "x " * 200, [5, 6, 7]], dtype=object)}
    out = predictor(batch)
    assert list(out["id"]) == [0, 1, 2] and list(out["prompt"]) == list(batch["prompt"])
    assert out["error_code"].tolist()[0] == 200 and out["error_code"].tolist()[2] == 200
    assert out["error_code"][1] == 400 and "max_model_len" in out["error_msg"][1]
    assert len(out["generated_token_ids"][0]) == 48 and len(out["generated_token_ids"][1]) == 0


@pytest.mark.parametrize("kwargs, batch, error, match", [
    ({"sampling_params": {"n": 2}}, None, ValueError, "n must be 1"),
    ({"llm_kwargs": ["max_model_len"]}, None, TypeError, "llm_kwargs must be a dict"),
    ({}, {"text": np.array(["a"])}, ValueError, "no 'prompt' column"),
    ({}, {"prompt": np.array(["a"]), "generated_text": np.array(["b"])}, ValueError, "output columns"),
    ({}, {"prompt": np.array([1.5])}, TypeError, "text or a list of token ids"),
])
def test_bad_arguments_are_refused(kwargs, batch, error, match) -> None:
    with pytest.raises(error, match=match):
        LLMPredictor(MODEL, **{"llm_kwargs": {"max_model_len": 64}, **kwargs})(batch)


def test_core_budget_is_shared_among_ranks() -> None:
    try:
        ops.limit_cores(1)
        ops.share_cores(1)
        assert ops.core_budget() == 1 and ops.runtime_info()["num_threads"] == 1
        with pytest.raises(ValueError, match="cores must be"):
            ops.limit_cores(0)
    finally:
        ops.limit_cores(None)
        ops.share_cores(1)
    assert ops.runtime_info()["num_threads"] == len(os.sched_getaffinity(0))
