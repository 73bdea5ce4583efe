"""The engine core's boundary and its thread-safe entry points.

References: each batch's outputs from a plain run on the same engine (which the batching-invariance
tests tie to one-request-at-a-time runs).
"""
import pickle
import threading
import time

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams

MAX_TOKENS = 48
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [np.random.default_rng(i).integers(3, 1000, size=12 + 5 * i).tolist() for i in range(4)]
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def llm(tiny_hf):
    return LLM(model=tiny_hf, block_size=16, max_num_seqs=4)


def token_ids(outputs):
    return [o.outputs.token_ids for o in outputs]


def wait_for(condition, what: str):
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.0005)


def running_request(llm, prompt, min_outputs: int):
    """The engine's request for `prompt` once it has `min_outputs` tokens (None before)."""
    for request in list(llm.engine.scheduler.requests.values()):
        if request.prompt_token_ids == prompt and request.num_output_tokens >= min_outputs:
            return request
    return None


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_abort_from_another_thread_while_generate_runs(llm, params):
    others = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    expected = token_ids(llm.generate(others, params, use_tqdm=False))
    free = llm.engine.block_manager.num_free_blocks
    result = {}
    worker = threading.Thread(target=lambda: result.update(out=llm.generate(PROMPTS, params, use_tqdm=False)))
    worker.start()
    target = []
    wait_for(lambda: target.append(running_request(llm, PROMPTS[1], 2)) or target[-1] is not None,
             "the target request to produce tokens")
    llm.engine.abort([target[-1].request_id])
    worker.join(DEADLINE_S)
    assert not worker.is_alive()
    out = result["out"]
    assert out[1].outputs.finish_reason == "abort" and out[1].finished
    assert 2 <= len(out[1].outputs.token_ids) < MAX_TOKENS
    assert [o.outputs.finish_reason for o in (out[0], out[2], out[3])] == ["length"] * 3
    assert token_ids([out[0], out[2], out[3]]) == expected
    assert llm.engine.block_manager.num_free_blocks == free
    assert not llm.engine.has_unfinished() and not llm.engine.output_processor.states


def test_requests_added_from_another_thread_while_a_loop_steps(llm):
    expected = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    engine = llm.engine
    requests = []
    stop = threading.Event()

    def loop():  # the server's engine loop: step while there is work, until told to stop
        deadline = time.monotonic() + DEADLINE_S
        while not stop.is_set() and time.monotonic() < deadline:
            if engine.has_unfinished():
                engine.step()
            else:
                time.sleep(0.0005)

    stepper = threading.Thread(target=loop)
    stepper.start()
    try:
        for i, prompt in enumerate(PROMPTS):
            request = engine.make_request(None, prompt, GREEDY, index=i)
            requests.append(request)
            engine.add_request(request)
            wait_for(lambda: request.num_output_tokens > 0, "the new request to start")
        wait_for(lambda: all(r.is_finished for r in requests), "all requests to finish")
    finally:
        stop.set()
        stepper.join(DEADLINE_S)
    assert token_ids(engine.make_output(r) for r in requests) == expected


def test_concurrent_generate_calls_share_the_engine(llm):
    expected = [token_ids(llm.generate(PROMPTS[:2], SAMPLED, use_tqdm=False)),
                token_ids(llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False))]
    results = [None, None]

    def run(slot, prompts, params):
        results[slot] = token_ids(llm.generate(prompts, params, use_tqdm=False))

    threads = [threading.Thread(target=run, args=(0, PROMPTS[:2], SAMPLED)),
               threading.Thread(target=run, args=(1, PROMPTS[2:], GREEDY))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert results == expected


def test_concurrent_streams_lose_no_delta(llm):
    """Two threads stream from one engine: each thread's steps also make the other's deltas, so a chunk may be
    due twice for one request between two looks; every delta still arrives, in order."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    results: list = [None, None]

    def run(slot: int, prompts: list) -> None:
        texts, ids = [""] * len(prompts), [[] for _ in prompts]
        for chunk in llm.generate(prompts, params, use_tqdm=False, stream=True):
            for i, out in enumerate(chunk):
                if out is not None:
                    texts[i] += out.outputs.text
                    ids[i] += out.outputs.token_ids
        results[slot] = (texts, ids)

    threads = [threading.Thread(target=run, args=(0, PROMPTS[:2])), threading.Thread(target=run, args=(1, PROMPTS[2:]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    texts = results[0][0] + results[1][0]
    ids = results[0][1] + results[1][1]
    assert texts == [o.outputs.text for o in expected] and ids == [o.outputs.token_ids for o in expected]


def test_what_crosses_the_boundary_is_plain_data(llm):
    engine = llm.engine
    request = engine.make_request(None, PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=2,
                                                                   prompt_logprobs=1), index=0)
    engine.scheduler.add(request)
    step = engine.scheduler.schedule()
    try:
        data = pickle.dumps(step.model_input)  # what a runner in another process would receive
        assert b"fastdeploy.engine" not in data  # no Request, no engine object
        output = engine.runner.execute(pickle.loads(data))
        assert len(output.sampled_token_ids) == 1
        assert len(output.logprobs) == 1 and len(output.prompt_logprobs) == len(PROMPTS[0]) - 1
        assert b"fastdeploy.engine" not in pickle.dumps(output)
    finally:
        engine.abort_now([request])
    assert not engine.has_unfinished()
