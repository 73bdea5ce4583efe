"""Issue 41, points 2 and 3: a fault in one request's output processing or delivery fails that request alone
(error 500) while the others complete as they would alone; tool-call parsers survive deeply nested JSON; a
dead engine loop turns /health to 503 and makes the server process exit non-zero."""
import asyncio
import subprocess
import sys
import threading
import time

import httpx
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.entrypoints.multimodal import prompts_for
from fastdeploy.entrypoints.openai.api_server import build_app
from fastdeploy.entrypoints.openai.engine_loop import EngineLoop
from fastdeploy.entrypoints.openai.serving import ServingContext
from fastdeploy.engine.output_processor import OutputProcessor
from fastdeploy.tool_parsers.forced import NamedCallParser, RequiredCallsParser
from fastdeploy.tool_parsers.parsers import ErnieX1ToolParser, HermesToolParser
from test_api_server import ROOT, free_port, wait_until_healthy

DEPTH = 10_000
MARK = "POISON"
PROMPTS = [f"Count to {i} and then say hello" for i in range(16)]
MAX_TOKENS = 8
TIMEOUT_S = 120.0


class Injected(Exception):
    """The fault the tests inject (its name must reach the client)."""


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# ---- tool-call parsers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("parser", [HermesToolParser(), ErnieX1ToolParser()])
def test_deeply_nested_tool_call_stays_text(parser):
    text = f'<tool_call>{{"name": "f", "arguments": {nested(DEPTH)}}}</tool_call>'
    for body in (text, text.replace(nested(DEPTH), f'"{nested(DEPTH)}"')):  # arguments as JSON, as a string
        split = parser.split(body, final=True)
        assert split.calls == [] and split.text == body


def test_deeply_nested_forced_calls_stay_text():
    objects = '{"a": ' * DEPTH + "1" + "}" * DEPTH
    assert NamedCallParser("f").split(objects, final=True).calls == []
    assert RequiredCallsParser().split(nested(DEPTH), final=True).calls == []


# ---- offline: LLM ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_hf):
    return LLM(model=tiny_hf, max_model_len=256, max_num_seqs=17)


@pytest.fixture(scope="module")
def alone(llm):
    """Each prompt's tokens run by itself (greedy)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return {p: llm.generate([p], params, use_tqdm=False)[0].outputs for p in PROMPTS}


def poison(monkeypatch, method: str) -> None:
    """Make OutputProcessor.`method` raise for the request whose prompt carries MARK."""
    original = getattr(OutputProcessor, method)

    def faulty(self, request, *args, **kwargs):
        state = self.states.get(request.request_id)
        if state is not None and state.prompt and MARK in state.prompt and request.num_output_tokens >= 2:
            raise Injected("injected")
        return original(self, request, *args, **kwargs)
    monkeypatch.setattr(OutputProcessor, method, faulty)


@pytest.mark.parametrize("method", ["on_token", "make_output"])
@pytest.mark.parametrize("stream", [False, True])
def test_llm_request_fault_fails_that_request_alone(llm, alone, monkeypatch, method, stream):
    poison(monkeypatch, method)
    free = llm.engine.block_manager.num_free_blocks
    prompts = PROMPTS[:8] + [f"{MARK} say something"] + PROMPTS[8:]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    if stream:
        last: dict[int, object] = {}
        tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        for chunk in llm.generate(prompts, params, use_tqdm=False, stream=True):
            for i, out in enumerate(chunk):
                if out is not None:
                    tokens[i] += out.outputs.token_ids
                    last[i] = out
        outputs = [last[i] for i in range(len(prompts))]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens = {i: o.outputs.token_ids for i, o in enumerate(outputs)}
    bad = outputs[8]
    assert bad.finished and bad.error_code == 500 and "Injected" in bad.error_msg
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        if i != 8:
            assert out.error_code == 200 and tokens[i] == alone[prompt].token_ids, prompt
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.output_processor.states
    assert engine.block_manager.num_free_blocks == free
    monkeypatch.undo()  # the engine still serves
    assert llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs.token_ids == alone[PROMPTS[0]].token_ids


@pytest.mark.parametrize("where", ["sync", "mask"])
def test_llm_grammar_fault_fails_that_request_alone(llm, alone, monkeypatch, where):
    from fastdeploy.engine.sampling_params import GuidedDecodingParams
    from fastdeploy.guided import matcher

    if where == "sync":
        def sync(self, output_ids):
            raise Injected("injected")
        monkeypatch.setattr(matcher.GrammarState, "sync", sync)
    else:  # the step's mask, on the grammar worker thread (compiling the spec is left alone)
        fill = matcher.ll_numpy.fill_next_token_bitmask

        def faulty_fill(m, bitmask, *row):
            if not row:  # compile() fills the template's first mask with no row index
                return fill(m, bitmask)
            raise Injected("injected")
        monkeypatch.setattr(matcher.ll_numpy, "fill_next_token_bitmask", faulty_fill)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    guided = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, guided_decoding=GuidedDecodingParams(regex="a+"))
    outputs = llm.generate(PROMPTS + [PROMPTS[0]], [params] * len(PROMPTS) + [guided], use_tqdm=False)
    assert outputs[-1].error_code == 500 and "Injected" in outputs[-1].error_msg
    for prompt, out in zip(PROMPTS, outputs):
        assert out.error_code == 200 and out.outputs.token_ids == alone[prompt].token_ids, prompt
    assert not llm.engine.has_unfinished() and not llm.engine.output_processor.states


# ---- server, in process: the app and the engine loop as api_server.main() builds them ---------------------------
class LoopThread:
    """The EngineLoop on a thread (main() runs it on the main thread); records how run() ended."""

    def __init__(self, llm: LLM):
        self.deaths: list[str] = []
        self.loop = EngineLoop(llm.engine, on_death=lambda: self.deaths.append("died"))
        ctx = ServingContext(llm.engine, self.loop, prompts_for(llm.engine.config, llm.engine.tokenizer), "tiny")
        self.app = build_app(ctx)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.loop.run()
        except BaseException as e:  # noqa: BLE001 - what the test checks
            self.error = e

    def stop(self) -> None:
        self.loop.close()
        self.thread.join(30)
        assert not self.thread.is_alive()


async def post_all(app, prompts: list[str]) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=TIMEOUT_S) as client:
        calls = [client.post("/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0}) for p in prompts]
        return await asyncio.wait_for(asyncio.gather(*calls), TIMEOUT_S)


async def health(app) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.get("/health")


@pytest.mark.parametrize("where", ["make_output", "deliver"])
def test_server_request_fault_is_that_calls_500(llm, alone, monkeypatch, where):
    if where == "deliver":  # the call's sink, which the engine calls inside its step
        original = EngineLoop._sink

        def faulty(self, loop, queue, output):
            if output.error_code == 200 and MARK in llm.engine.tokenizer.decode(output.prompt_token_ids):
                raise Injected("injected")
            return original(self, loop, queue, output)
        monkeypatch.setattr(EngineLoop, "_sink", faulty)
    else:
        poison(monkeypatch, "make_output")
    server = LoopThread(llm)
    try:
        prompts = PROMPTS[:8] + [f"{MARK} say something"] + PROMPTS[8:]
        responses = asyncio.run(post_all(server.app, prompts))
        bad = responses[8]
        assert bad.status_code == 500, bad.text
        error = bad.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and "Injected" in error["message"]
        for prompt, response in zip(prompts, responses):
            if MARK not in prompt:
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == alone[prompt].text
        assert asyncio.run(health(server.app)).status_code == 200
        assert not server.deaths and server.thread.is_alive()
        deadline = time.monotonic() + 30  # the failed request's blocks are freed at once, the rest finished
        while llm.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not llm.engine.has_unfinished() and not llm.engine.output_processor.states
    finally:
        server.stop()
    assert server.error is None


class Fatal(BaseException):
    """Escapes every per-request and per-step handler: the loop itself dies."""


@pytest.mark.parametrize("fault", ["escapes", "every step fails"])
def test_dead_loop_turns_health_503(llm, monkeypatch, fault):
    from fastdeploy.engine.engine import LLMEngine

    def step(self):
        raise Fatal("dead") if fault == "escapes" else Injected("broken runner")
    monkeypatch.setattr(LLMEngine, "step", step)
    server = LoopThread(llm)
    try:
        assert asyncio.run(health(server.app)).status_code == 200
        for _ in range(3):  # a step failing once fails its calls only; the third in a row kills the loop
            response = asyncio.run(post_all(server.app, [PROMPTS[0]]))[0]
            assert response.status_code == 500 and "error" in response.json()
            if fault == "escapes":
                break
        server.thread.join(30)
        assert not server.thread.is_alive() and server.deaths == ["died"]
        assert isinstance(server.error, Fatal if fault == "escapes" else Injected)
        response = asyncio.run(health(server.app))
        assert response.status_code == 503 and "died" in response.json()["error"]["message"]
    finally:
        server.stop()
        monkeypatch.undo()
        llm.engine.fail_all("test over")  # what the failed steps left queued


SERVER_WITH_BROKEN_STEP = """
import sys
from fastdeploy.engine.engine import LLMEngine
from fastdeploy.entrypoints.openai import api_server

def step(self):
    raise RuntimeError("broken runner")
LLMEngine.step = step
api_server.main(sys.argv[1:])
"""


def test_server_process_exits_nonzero_when_its_loop_dies(tiny_hf):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", SERVER_WITH_BROKEN_STEP, "--model", tiny_hf, "--host", "127.0.0.1",
                             "--port", str(port), "--max-model-len", "256", "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(proc, url)
        body = {"model": tiny_hf, "prompt": "hello", "max_tokens": 4}
        for _ in range(3):
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT_S)
            assert response.status_code == 500 and "error" in response.json()
        try:
            assert httpx.get(f"{url}/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone
        assert proc.wait(60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
