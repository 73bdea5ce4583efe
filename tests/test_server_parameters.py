"""Every parameter of FastDeploy's docs/parameters.md table (PaddlePaddle/FastDeploy at commit
0242c96826835bebaebcf8e8547d3ea4d9401b75, in its order) is a flag of our server that is honoured, or refused at
start-up with a message naming it; and --max-waiting-time does what online_serving.md says (the app in-process,
its engine held busy so that a second request has to wait for the one seat)."""
from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import pytest

from fastdeploy import LLM
from fastdeploy.engine.args_utils import ENGINE_FIELDS
from fastdeploy.entrypoints.multimodal import prompts_for
from fastdeploy.entrypoints.openai.api_server import build_app, main
from fastdeploy.entrypoints.openai.cli_args import NOT_IMPLEMENTED_FLAGS, engine_config, make_parser
from fastdeploy.entrypoints.openai.engine_loop import EngineLoop
from fastdeploy.entrypoints.openai.serving import ServingContext
from fastdeploy.not_implemented_args import NOT_IMPLEMENTED

from conftest import FIXTURES, TINY_HF

VL = str(FIXTURES / "models" / "ernie45_vl_tiny_hf")
BASE = ["--model", str(TINY_HF), "--max-model-len", "64"]
TIMEOUT_S = 60
ENGINE_NAMES = {f.name for f in ENGINE_FIELDS}
HONOURED, REFUSED = "honoured", "refused"

# (name, flags a FastDeploy user passes, outcome, detail). Honoured: detail is the value the engine config (an
# LLM parameter) or the server's arguments (a server flag) then hold. Refused: detail is the flags giving
# FastDeploy's default, which are accepted.
PARAMETERS_MD = [
    ("port", ["--port", "8180"], HONOURED, 8180),
    ("metrics_port", ["--metrics-port", "8181"], HONOURED, 8181),
    ("max_waiting_time", ["--max-waiting-time", "10"], HONOURED, 10.0),
    ("max_concurrency", ["--max-concurrency", "512"], HONOURED, 512),
    ("engine_worker_queue_port", ["--engine-worker-queue-port", "8102"], HONOURED, 8102),
    ("cache_queue_port", ["--cache-queue-port", "8003"], REFUSED, []),
    ("max_model_len", ["--max-model-len", "32"], HONOURED, 32),
    ("tensor_parallel_size", ["--tensor-parallel-size", "2"], HONOURED, 2),
    ("data_parallel_size", ["--data-parallel-size", "2"], HONOURED, 2),  # the server's (data_parallel.py)
    ("block_size", ["--block-size", "32"], HONOURED, 32),
    ("max_num_seqs", ["--max-num-seqs", "4"], HONOURED, 4),
    ("mm_processor_kwargs", ["--model", VL, "--mm-processor-kwargs", '{"image_min_pixels": 3136, "video_fps": 2}'],
     HONOURED, {"image_min_pixels": 3136, "video_fps": 2}),
    ("tokenizer", ["--tokenizer", str(TINY_HF)], HONOURED, str(TINY_HF)),
    ("use_warmup", ["--use-warmup", "1"], HONOURED, 1),
    ("limit_mm_per_prompt", ["--model", VL, "--limit-mm-per-prompt", '{"image": 10, "video": 3}'], HONOURED,
     {"image": 10, "video": 3}),
    ("enable_mm", ["--model", VL, "--enable-mm"], HONOURED, True),
    ("quantization", ["--quantization", "wint8"], HONOURED, "wint8"),
    ("gpu_memory_utilization", ["--gpu-memory-utilization", "0.5"], HONOURED, 0.5),
    ("num_gpu_blocks_override", ["--num-gpu-blocks-override", "100"], HONOURED, 100),
    ("max_num_batched_tokens", ["--max-num-batched-tokens", "128"], HONOURED, 128),
    ("kv_cache_ratio", ["--kv-cache-ratio", "0.5"], HONOURED, 0.5),
    ("enable_prefix_caching", ["--no-enable-prefix-caching"], HONOURED, False),
    ("swap_space", ["--swap-space", "4"], REFUSED, []),
    ("enable_chunked_prefill", ["--enable-chunked-prefill"], HONOURED, True),
    ("max_num_partial_prefills", ["--max-num-partial-prefills", "2"], REFUSED, ["--max-num-partial-prefills", "1"]),
    ("max_long_partial_prefills", ["--max-long-partial-prefills", "2"], REFUSED,
     ["--max-long-partial-prefills", "1"]),
    ("long_prefill_token_threshold", ["--long-prefill-token-threshold", "100"], REFUSED,
     ["--long-prefill-token-threshold", "0"]),
    ("static_decode_blocks", ["--static-decode-blocks", "4"], REFUSED, ["--static-decode-blocks", "2"]),
    ("reasoning_parser", ["--reasoning-parser", "ernie-x1"], HONOURED, "ernie-x1"),
    ("use_cudagraph", ["--use-cudagraph"], REFUSED, []),
    ("graph_optimization_config", ["--graph-optimization-config", '{"use_cudagraph":true, "graph_opt_level":0}'],
     REFUSED, []),
    ("disable_custom_all_reduce", ["--disable-custom-all-reduce"], REFUSED, []),
    ("splitwise_role", ["--splitwise-role", "prefill"], REFUSED, ["--splitwise-role", "mixed"]),
    ("innode_prefill_ports", ["--innode-prefill-ports", "8182"], REFUSED, []),
    ("guided_decoding_backend", ["--guided-decoding-backend", "off"], HONOURED, "off"),
    ("guided_decoding_disable_any_whitespace", ["--guided-decoding-disable-any-whitespace"], HONOURED, True),
    ("speculative_config", ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], HONOURED,
     {"method": "ngram", "num_speculative_tokens": 2}),
    ("dynamic_load_weight", ["--dynamic-load-weight"], REFUSED, []),
    ("enable_expert_parallel", ["--enable-expert-parallel"], REFUSED, []),
    ("enable_logprob", ["--enable-logprob"], HONOURED, True),
    ("served_model_name", ["--served-model-name", "ernie"], HONOURED, "ernie"),
    ("revision", ["--revision", "main"], HONOURED, "main"),
    ("chat_template", ["--chat-template", "{{ messages[0]['content'] }}"], HONOURED, "{{ messages[0]['content'] }}"),
    ("tool_call_parser", ["--tool-call-parser", "hermes"], HONOURED, "hermes"),
    ("lm_head_fp32", ["--lm-head-fp32"], HONOURED, True),
]


@pytest.mark.parametrize("name, flags, outcome, detail", PARAMETERS_MD, ids=[row[0] for row in PARAMETERS_MD])
def test_fastdeploy_parameter_is_a_flag_honoured_or_refused_by_name(name, flags, outcome, detail):
    parser = make_parser()
    args = parser.parse_args([*BASE, *flags])
    if outcome == HONOURED:
        assert getattr(engine_config(args) if name in ENGINE_NAMES else args, name) == detail
        return
    flag = "--" + name.replace("_", "-")
    with pytest.raises(NotImplementedError, match=re.escape(name)) as refusal:
        engine_config(args)
    assert name in ENGINE_NAMES or str(refusal.value).startswith(f"{flag}: ")
    engine_config(parser.parse_args([*BASE, *detail]))  # FastDeploy's default describes this engine


def test_every_fastdeploy_only_flag_defaults_to_fastdeploys_default():
    args = make_parser().parse_args(BASE)
    assert {n: getattr(args, n) for n in NOT_IMPLEMENTED_FLAGS} == {
        n: NOT_IMPLEMENTED[n] for n in NOT_IMPLEMENTED_FLAGS}
    engine_config(args)  # none of them given: every one at FastDeploy's default, accepted
    with pytest.raises(NotImplementedError, match="--logits-processors: logits_processors="):
        engine_config(make_parser().parse_args([*BASE, "--logits-processors", "a.B", "c.D"]))


def test_a_refused_flag_stops_the_server_before_loading(capsys):
    with pytest.raises(SystemExit) as stopped:
        main([*BASE, "--splitwise-role", "prefill"])
    assert stopped.value.code == 2
    assert "--splitwise-role: splitwise_role='prefill' is not implemented" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["nan", "soon"])
def test_max_waiting_time_must_be_seconds(text, capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args([*BASE, "--max-waiting-time", text])
    assert "--max-waiting-time" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ --max-waiting-time


def test_a_request_still_waiting_after_max_waiting_time_gets_408_and_is_aborted(monkeypatch):
    llm = LLM(str(TINY_HF), max_model_len=64, max_num_seqs=1)
    engine = llm.engine
    stepped, release = threading.Event(), threading.Event()
    real_step = engine.step

    def held_step():  # the engine stays busy on its first request until released: the next ones must wait
        out = real_step()
        stepped.set()
        release.wait(TIMEOUT_S)
        return out

    monkeypatch.setattr(engine, "step", held_step)
    loop = EngineLoop(engine)
    aborted = []
    real_abort = loop.abort
    monkeypatch.setattr(loop, "abort", lambda ids: (aborted.extend(engine._routes[i].request for i in ids),
                                                    real_abort(ids)))
    ctx = ServingContext(engine, loop, prompts_for(llm.config, engine.tokenizer), "tiny", max_waiting_time=0.2)
    stepper = threading.Thread(target=loop.run, daemon=True)
    stepper.start()
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}

    async def calls():
        transport = httpx.ASGITransport(app=build_app(ctx))
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=TIMEOUT_S) as http:
            first = asyncio.create_task(http.post("/v1/completions", json=body))
            assert await asyncio.to_thread(stepped.wait, TIMEOUT_S)  # the first request has the only seat
            chat = http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            stream = http.post("/v1/completions", json={**body, "stream": True})
            waited = await asyncio.gather(chat, stream)
            release.set()
            return await first, waited

    try:
        first, waited = asyncio.run(asyncio.wait_for(calls(), TIMEOUT_S))
    finally:
        release.set()
        loop.close()
        stepper.join(TIMEOUT_S)
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 4
    for response in waited:  # the stream too: refused before it starts
        assert response.status_code == 408
        error = json.loads(response.text)["error"]
        assert (error["code"], error["type"]) == (408, "timeout_error")
        assert "--max-waiting-time=0.2" in error["message"]
    assert len(aborted) == 2
    for _ in range(int(TIMEOUT_S / 0.05)):  # the engine loop has stopped: step the aborts through by hand
        if not engine.has_unfinished():
            break
        real_step()
    assert all(r.finish_reason == "abort" and r.num_output_tokens == 0 for r in aborted)
