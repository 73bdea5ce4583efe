"""RequestOutput / CompletionOutput / RequestMetrics as FastDeploy 2.x declares them (engine/request.py,
docs/offline_inference.md): every field, to_dict/from_dict through JSON, the metrics' meanings checked
against clocks read around a real run, and uuid request ids."""
import json
import time
import uuid
from dataclasses import fields

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from fastdeploy.worker.output import Logprob

PROMPTS = [[17, 250, 33, 480, 91, 700, 12, 5], [9, 8, 7, 6, 5]]

# FastDeploy's field names (its declarations, the docs' lists and what its token processor sets).
FD_REQUEST_OUTPUT = {"request_id", "prompt", "prompt_token_ids", "outputs", "finished", "metrics",
                     "num_cached_tokens", "num_input_image_tokens", "num_input_video_tokens",
                     "prompt_token_ids_len", "error_code", "error_msg", "prompt_logprobs"}
FD_COMPLETION_OUTPUT = {"index", "send_idx", "token_ids", "decode_type", "logprob", "top_logprobs", "logprobs",
                        "draft_token_ids", "text", "reasoning_content", "tool_calls"}
FD_METRICS = {"arrival_time", "inference_start_time", "first_token_time", "time_in_queue",
              "preprocess_cost_time", "model_forward_time", "model_execute_time", "request_start_time"}


@pytest.fixture(scope="module")
def llm(tiny_hf):
    return LLM(model=tiny_hf, block_size=16, max_num_seqs=4, max_logprobs=-1)


def names(cls) -> set[str]:
    return {f.name for f in fields(cls)}


def test_every_fastdeploy_field_is_present():
    assert FD_REQUEST_OUTPUT <= names(RequestOutput)
    assert FD_COMPLETION_OUTPUT <= names(CompletionOutput)
    assert names(RequestMetrics) == FD_METRICS | {"num_draft_tokens", "num_accepted_tokens"}  # speculation's


def test_fastdeploy_defaults():
    out = RequestOutput("x")
    assert (out.prompt, out.prompt_token_ids, out.outputs, out.finished, out.metrics) == (None, [], None, False, None)
    assert (out.num_cached_tokens, out.error_code, out.error_msg, out.prompt_token_ids_len) == (0, 200, None, 0)
    assert RequestOutput("x", prompt_token_ids=[4, 5, 6]).prompt_token_ids_len == 3
    c = CompletionOutput(index=0, send_idx=0, token_ids=[])
    assert (c.decode_type, c.logprob, c.top_logprobs, c.draft_token_ids, c.tool_calls) == (0, None, None, [], None)
    assert RequestMetrics(1.0).to_dict() == dict.fromkeys(FD_METRICS - {"arrival_time"}) | {
        "arrival_time": 1.0, "num_draft_tokens": 0, "num_accepted_tokens": 0}


def json_round_trip(out: RequestOutput) -> RequestOutput:
    return RequestOutput.from_dict(json.loads(json.dumps(out.to_dict())))


def test_round_trip_of_a_built_output():
    lp = {5: Logprob(-0.25, 1, "a"), 9: Logprob(-1.5, 2, None)}
    out = RequestOutput(
        request_id=str(uuid.uuid4()), prompt="hi", prompt_token_ids=[1, 2], finished=True,
        outputs=CompletionOutput(index=1, send_idx=1, token_ids=[5, 9], text="ab", reasoning_content="r",
                                 logprob=-1.5, logprobs=[lp, lp], finish_reason="stop", stop_reason=9,
                                 tool_calls=[{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": "{}"}}]),
        metrics=RequestMetrics(10.0, 10.5, 0.1, 0.2, 0.3, 0.4, 0.9, 10.0), num_cached_tokens=16,
        error_code=400, error_msg="bad", prompt_logprobs=[None, lp], num_input_image_tokens=3)
    back = json_round_trip(out)
    assert back == out
    assert isinstance(back.outputs.logprobs[0][5], Logprob) and isinstance(back.prompt_logprobs[1][9], Logprob)
    assert RequestMetrics.from_dict(out.metrics.to_dict()) == out.metrics
    assert CompletionOutput.from_dict(out.outputs.to_dict()) == out.outputs


def test_from_dict_names_unknown_keys():
    with pytest.raises(TypeError, match="bogus"):
        RequestOutput.from_dict({"request_id": "a", "bogus": 1})
    with pytest.raises(TypeError, match="bogus"):
        RequestMetrics.from_dict({"arrival_time": 0.0, "bogus": 1})


def test_round_trip_of_real_outputs_with_logprobs(llm):
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=1),
                        use_tqdm=False)
    for out in outs:
        assert out.outputs.logprobs and out.prompt_logprobs
        assert json_round_trip(out) == out
        last = out.outputs.token_ids[-1]
        assert out.outputs.logprob == out.outputs.logprobs[-1][last].logprob
        assert out.outputs.draft_token_ids == [] and out.outputs.decode_type == 0
        assert out.prompt_token_ids_len == len(out.prompt_token_ids)
    plain = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.outputs.logprob is None and plain.outputs.logprobs is None


def test_metrics_mean_what_fastdeploy_says(llm):
    before = time.time()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    after = time.time()
    for out in outs:
        m = out.metrics
        # Timestamps: arrival (before preprocessing) <= first scheduled, inside the call; request_start_time
        # is the arrival again.
        assert before <= m.arrival_time <= m.inference_start_time <= after
        assert m.request_start_time == m.arrival_time
        # Durations, each bounded by the call and consistent with the others.
        assert 0 <= m.preprocess_cost_time and 0 <= m.time_in_queue
        assert m.arrival_time + m.preprocess_cost_time + m.time_in_queue == pytest.approx(m.inference_start_time)
        assert 0 <= m.first_token_time <= m.model_forward_time  # from inference start: first, last token
        assert m.inference_start_time + m.model_forward_time <= after
        assert m.model_execute_time >= m.model_forward_time  # from arrival: includes preprocessing and queue
        assert m.arrival_time + m.model_execute_time <= after
        assert m.model_execute_time == pytest.approx(m.inference_start_time - m.arrival_time + m.model_forward_time,
                                                     abs=0.05)


def test_stream_first_token_time_is_a_duration_from_inference_start(llm):
    seen = []
    for chunk in llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False,
                              stream=True):
        if chunk[0] is not None:
            seen.append((time.time(), chunk[0].metrics))
    received, first = seen[0]
    # The first delta arrives after its token was sampled: inference start + first_token_time <= then.
    assert first.inference_start_time + first.first_token_time <= received
    assert all(m.first_token_time == first.first_token_time for _, m in seen)
    # Each delta carries its own snapshot: later tokens move model_forward_time on, earlier ones keep theirs.
    forward = [m.model_forward_time for _, m in seen]
    assert forward == sorted(forward) and len({id(m) for _, m in seen}) == len(seen)


def test_request_ids_are_unique_uuid4_strings_across_instances(tiny_hf, llm):
    other = LLM(model=tiny_hf, block_size=16, max_num_seqs=4)
    params = SamplingParams(max_tokens=1, n=2)
    ids = [o.request_id for engine in (llm, other) for o in engine.generate(PROMPTS, params, use_tqdm=False)]
    assert len(ids) == 8 and len(set(ids)) == 8
    assert all(uuid.UUID(i).version == 4 and str(uuid.UUID(i)) == i for i in ids)
