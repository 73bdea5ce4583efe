"""The OpenAI-compatible server, started as a subprocess on 127.0.0.1 and driven by the official `openai`
client; every result is checked against LLM.generate / LLM.chat in this process on the same model."""
import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from fastdeploy import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key"
MAX_MODEL_LEN = 256
TIMEOUT_S = 120.0
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str) -> None:
    """Until the server process at `url` answers /health with 200, at most TIMEOUT_S; raises if it exits first."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


class Server:
    def __init__(self, model: str, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
             "--port", str(self.port), "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning", *flags],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_until_healthy(self.proc, self.url)

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, timeout=TIMEOUT_S, max_retries=0)

    def metrics(self, url: str | None = None) -> dict[str, float]:
        text = httpx.get(url or f"{self.url}/metrics", timeout=10).text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line.startswith("fastdeploy:")}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tiny_hf):
    s = Server(tiny_hf, "--api-key", KEY, "--api-key", "second-key", "--reasoning-parser", "ernie-x1",
               "--max-num-seqs", "16", "--served-model-name", "tiny")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def llm(tiny_hf):
    return LLM(model=tiny_hf, max_model_len=MAX_MODEL_LEN, max_num_seqs=16, reasoning_parser="ernie-x1")


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


# ---------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_equals_llm_chat(server, llm, thinking):
    kwargs = {"enable_thinking": thinking}
    ref = llm.chat(MESSAGES, greedy(max_tokens=12), chat_template_kwargs=kwargs, use_tqdm=False)[0]
    r = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=12,
        extra_body={"chat_template_kwargs": kwargs, "return_token_ids": True})
    choice = r.choices[0]
    assert choice.message.content == ref.outputs.text
    assert choice.message.reasoning_content == ref.outputs.reasoning_content
    assert (choice.message.reasoning_content != "") == thinking  # the parser splits only when thinking
    assert choice.message.completion_token_ids == ref.outputs.token_ids
    assert choice.finish_reason == ref.outputs.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12 and r.model == "tiny"


def test_streamed_chat_joins_to_the_whole_answer(server, llm):
    ref = llm.chat(MESSAGES, greedy(max_tokens=16, stop=["e"]), use_tqdm=False)[0]
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=16, stop=["e"], stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ref.outputs.text
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == ref.outputs.reasoning_content
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == [ref.outputs.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs.token_ids)


@pytest.mark.parametrize("prompt", ["The quick brown fox", [5, 17, 99, 4, 250]], ids=["text", "token_ids"])
def test_completion_equals_llm_generate(server, llm, prompt):
    ref = llm.generate([prompt], greedy(max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    r = server.client().completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=10,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    assert (r.choices[0].text, r.choices[0].reasoning_content) == (ref.outputs.text, ref.outputs.reasoning_content)
    assert r.choices[0].completion_token_ids == ref.outputs.token_ids
    streamed = list(server.client().completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=10,
                                                       stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == ref.outputs.text
    assert "".join(getattr(c.choices[0], "reasoning_content", None) or "" for c in streamed if c.choices) == \
        ref.outputs.reasoning_content


def test_seeded_n_samples_equal_llm_generate(server, llm):
    params = SamplingParams(n=3, temperature=0.9, top_p=0.95, seed=11, max_tokens=8, ignore_eos=True)
    ref = llm.generate(["Once upon a time"], params, use_tqdm=False)
    r = server.client().completions.create(model="tiny", prompt="Once upon a time", n=3, temperature=0.9,
                                           top_p=0.95, seed=11, max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    got = [(c.text, c.reasoning_content) for c in r.choices]  # the server runs the ernie-x1 parser
    assert got == [(o.outputs.text, o.outputs.reasoning_content) for o in ref]
    assert len(set(got)) > 1  # three samples, not one repeated
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens == len(ref[0].prompt_token_ids)


def test_logprobs_equal_llm_generate(server, llm):
    ref = llm.chat(MESSAGES, greedy(max_tokens=4, logprobs=3), use_tqdm=False)[0]
    r = server.client().chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=4,
                                                logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for position, token_id, entry in zip(content, ref.outputs.token_ids, ref.outputs.logprobs):
        assert position.logprob == pytest.approx(entry[token_id].logprob, abs=1e-5)
        best = sorted(entry.values(), key=lambda lp: lp.rank)[:3]
        assert [t.token for t in position.top_logprobs] == [lp.decoded_token for lp in best]
        assert [t.logprob for t in position.top_logprobs] == pytest.approx([lp.logprob for lp in best], abs=1e-5)
    comp = server.client().completions.create(model="tiny", prompt=[5, 6, 7], temperature=0, max_tokens=3,
                                              logprobs=2)
    ref2 = llm.generate([[5, 6, 7]], greedy(max_tokens=3, logprobs=2), use_tqdm=False)[0]
    lp = comp.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(
        [e[t].logprob for t, e in zip(ref2.outputs.token_ids, ref2.outputs.logprobs)], abs=1e-5)
    output_text = comp.choices[0].reasoning_content + comp.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs) and "".join(lp.tokens) == output_text


# ---------------------------------------------------------------------------------- many clients


def test_64_concurrent_streams_each_get_their_own_output(server, llm):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 1000, size=int(rng.integers(4, 40))).tolist() for _ in range(64)]
    lengths = [int(n) for n in rng.integers(1, 24, size=64)]
    refs = [llm.generate([p], greedy(max_tokens=n, ignore_eos=True), use_tqdm=False)[0].outputs.token_ids
            for p, n in zip(prompts, lengths)]
    before = server.metrics()

    async def one(client: openai.AsyncOpenAI, prompt: list[int], n: int) -> list[int]:
        stream = await client.completions.create(
            model="tiny", prompt=prompt, temperature=0, max_tokens=n, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        ids = []
        async for chunk in stream:
            for choice in chunk.choices:
                ids += choice.completion_token_ids or []
        return ids

    async def run() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=TIMEOUT_S, max_retries=0)
        async with client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths))),
                                          TIMEOUT_S)

    assert asyncio.run(run()) == refs
    after = server.metrics()
    assert after["fastdeploy:request_success_total"] - before["fastdeploy:request_success_total"] == 64
    assert after["fastdeploy:generation_tokens_total"] - before["fastdeploy:generation_tokens_total"] == sum(lengths)
    assert (after["fastdeploy:prompt_tokens_total"] - before["fastdeploy:prompt_tokens_total"]
            == sum(len(p) for p in prompts))
    ttft = "fastdeploy:time_to_first_token_seconds_count"
    assert after[ttft] - before[ttft] == 64
    assert after["fastdeploy:num_requests_running"] == 0 and after["fastdeploy:gpu_cache_usage_perc"] == 0


def test_a_client_dropped_mid_stream_frees_its_request(server):
    idle = server.metrics()["fastdeploy:gpu_cache_usage_perc"]
    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=TIMEOUT_S,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]  # some tokens arrived; then the client goes away
    assert any(line.startswith("data: {") for line in got)
    deadline = time.monotonic() + TIMEOUT_S
    while True:  # the abort lands at the next step boundary
        m = server.metrics()
        if m["fastdeploy:num_requests_running"] == 0 and m["fastdeploy:gpu_cache_usage_perc"] == idle:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert m["fastdeploy:generation_tokens_total"] > 0
    assert server.client().completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("body, status, name", [
    ({"messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
    ({"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ({"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"messages": MESSAGES, "no_such_field": 1}, 400, "no_such_field"),
    ({"messages": MESSAGES, "model": "other"}, 404, "other"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, 400, "max_model_len"),
    ({"messages": MESSAGES, "top_logprobs": 2}, 400, "logprobs"),
])
def test_bad_requests_get_the_right_status_and_name_the_problem(server, body, status, name):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=TIMEOUT_S)
    assert r.status_code == status
    error = r.json()["error"]
    assert name in error["message"] and error["code"] == status and error["type"]
    assert "Traceback" not in r.text


def test_malformed_json_and_api_keys(server):
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", timeout=10,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert server.client("second-key").models.list().data[0].id == "tiny"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # not behind the key
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        server.client().completions.create(model="tiny", prompt="hi", max_tokens=-3)
    assert server.client().completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2


# ---------------------------------------------------------------------------------- flags, TP, shutdown


def test_every_llm_parameter_is_a_flag_with_the_same_default():
    import dataclasses

    from fastdeploy.config import EngineConfig
    from fastdeploy.entrypoints.openai.cli_args import engine_config, make_parser

    args = make_parser().parse_args(["--model", "m"])
    for f in dataclasses.fields(EngineConfig):
        if f.init and f.name != "model":
            assert getattr(args, f.name) == f.default, f.name
    args = make_parser().parse_args(["--model", "m", "--no-enable-prefix-caching", "--limit-mm-per-prompt",
                                     '{"image": 2}', "--max-num-seqs", "3"])
    assert (args.enable_prefix_caching, args.limit_mm_per_prompt, args.max_num_seqs) == (False, {"image": 2}, 3)
    documented = (ROOT / "docs" / "online_serving.md").read_text()
    flags = [o for a in make_parser()._actions for o in a.option_strings if o.startswith("--") and o != "--help"]
    assert [f for f in flags if f"`{f}`" not in documented] == []
    with pytest.raises(ValueError, match="model"):  # the same validation as LLM()
        engine_config(args)
    bad = subprocess.run([sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server", "--model",
                          str(ROOT / "tests/fixtures/models/ernie45_tiny_hf"), "--max-num-seqs", "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert bad.returncode == 2 and "max_num_seqs" in bad.stderr


def test_tensor_parallel_server_limits_concurrency_and_shuts_down_cleanly(tiny_hf, llm):
    metrics_port = free_port()
    s = Server(tiny_hf, "--tensor-parallel-size", "2", "--max-concurrency", "1", "--metrics-port",
               str(metrics_port), "--timeout-graceful-shutdown", "30")
    try:
        workers = subprocess.run(["pgrep", "-P", str(s.proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 1  # rank 1
        ref = llm.generate([[9, 8, 7]], greedy(max_tokens=40, ignore_eos=True), use_tqdm=False)[0].outputs.token_ids
        client = s.client()
        stream = client.completions.create(model=tiny_hf, prompt=[9, 8, 7], temperature=0, max_tokens=40, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        ids = list(next(iter(stream)).choices[0].completion_token_ids or [])
        with pytest.raises(openai.RateLimitError):  # one call at a time
            client.completions.create(model=tiny_hf, prompt="hi", max_tokens=2)
        s.proc.send_signal(signal.SIGTERM)  # while the stream runs: it may finish, then the server exits
        for chunk in stream:
            ids += chunk.choices[0].completion_token_ids or [] if chunk.choices else []
        assert ids == ref
        assert s.proc.wait(60) == 0
        for pid in workers:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2)
    finally:
        s.stop()
