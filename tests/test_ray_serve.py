"""API server replicas on Ray Serve (fastdeploy.integrations.ray_serve): a local Ray with 2 CPUs, two replicas of a
tiny model behind Serve's proxy on 127.0.0.1, driven by the official `openai` client. Answers equal one plain LLM
run's, whole and streamed, many calls at once; the server's API keys hold; a killed replica is replaced while the
other keeps answering."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
import ray
from ray import serve

from fastdeploy import LLM, SamplingParams
from fastdeploy.integrations.ray_serve import app_builder, build_openai_app, parse_server_args
from tests.conftest import FIXTURES
from tests.test_api_server import KEY, TIMEOUT_S, free_port

MODEL = str(FIXTURES / "models" / "ernie45_tiny_hf")
PROMPTS = [f"Call {i}: " + " ".join(f"w{(i * 5 + j) % 29}" for j in range(i % 7 + 2)) for i in range(16)]
MAX_TOKENS = 24
APP = "fastdeploy-test"


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    outputs = LLM(model=MODEL, max_model_len=256).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return {p: o.outputs.text for p, o in zip(PROMPTS, outputs)}


@pytest.fixture(scope="module")
def url():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_openai_app(["--model", MODEL, "--max-model-len", "256", "--api-key", KEY,
                                    "--log-level", "warning"], num_replicas=2, num_cpus=1),
                  name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=TIMEOUT_S, max_retries=0)


def complete(url: str, prompt: str, stream: bool) -> str:
    kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    if not stream:
        return client(url).completions.create(**kwargs).choices[0].text
    return "".join(c.choices[0].text for c in client(url).completions.create(**kwargs, stream=True) if c.choices)


def replica_states() -> dict[str, int]:
    deployments = serve.status().applications[APP].deployments
    return dict(next(iter(deployments.values())).replica_states)


def test_many_calls_at_once_answer_as_one_llm_whole_and_streamed(url, expected) -> None:
    assert replica_states() == {"RUNNING": 2}
    calls = [(p, stream) for p in PROMPTS for stream in (False, True)]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda call: complete(url, *call), calls))
    assert texts == [expected[p] for p, _ in calls]


def test_the_servers_flags_hold_behind_the_proxy(url) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(url, "wrong-key").completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client(url).completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
    assert "fastdeploy:num_requests_running" in httpx.get(f"{url}/metrics", timeout=10).text  # the replica's own


def replica_pids() -> set[int]:
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if "ServeReplica" in " ".join(p.info["cmdline"] or []) and "OpenAIServer" in " ".join(p.info["cmdline"])}


def test_a_killed_replica_is_replaced_while_the_other_answers(url, expected) -> None:
    before = replica_pids()
    assert len(before) == 2
    killed = min(before)
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + TIMEOUT_S
    answered = 0
    while not (killed not in (now := replica_pids()) and len(now) == 2 and replica_states() == {"RUNNING": 2}):
        assert time.monotonic() < deadline, f"not replaced: {replica_states()}"
        prompt = PROMPTS[answered % len(PROMPTS)]
        try:
            text = complete(url, prompt, stream=False)
        except openai.APIError:  # a call routed to the dead replica before Serve noticed
            continue
        assert text == expected[prompt]
        answered += 1
    assert answered > 0
    test_many_calls_at_once_answer_as_one_llm_whole_and_streamed(url, expected)  # the new replica answers too


def test_flags_a_replica_cannot_take_are_refused() -> None:
    for flag in ("--port", "--host", "--metrics-port", "--data-parallel-size"):
        with pytest.raises(ValueError, match=flag):
            parse_server_args(["--model", MODEL, flag, "2"])
    with pytest.raises(ValueError, match="--port"):
        parse_server_args(["--model", MODEL, "--port=9000"])
    with pytest.raises(ValueError, match="not valid"):
        parse_server_args(["--model", MODEL, "--no-such-flag"])
    with pytest.raises(TypeError, match="server_args"):
        parse_server_args(f"--model {MODEL}")
    with pytest.raises(ValueError, match="num_replicas"):
        build_openai_app(["--model", MODEL], num_replicas=0)
    with pytest.raises(ValueError, match="num_cpus"):
        build_openai_app(["--model", MODEL], num_cpus=-1)
    with pytest.raises(ValueError, match="unknown arguments"):
        app_builder({"args": f"--model {MODEL}", "replicas": "2"})
    with pytest.raises(ValueError, match="args is required"):
        app_builder({"num_replicas": "2"})
