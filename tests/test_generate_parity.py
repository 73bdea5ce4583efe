"""LLM.generate reproduces transformers' greedy continuations and logprobs (committed JSON made by
tools/make_model_reference.py) for both checkpoint layouts, all prompts batched together, with the
compiled ops and with their pure-Paddle references."""
import json

import pytest

from conftest import REFERENCE, compiled_ops
from fastdeploy import LLM, SamplingParams

REF = json.loads((REFERENCE / "ernie45_tiny_greedy.json").read_text())
CASES = REF["cases"]
TOP_K = REF["top_k"]


@pytest.fixture(scope="module", params=[("tiny_hf", True), ("tiny_paddle", True), ("tiny_hf", False)],
                ids=["hf", "paddle", "hf-reference-ops"])
def outputs(request):
    fixture, compiled = request.param
    with compiled_ops(compiled):
        llm = LLM(model=request.getfixturevalue(fixture), block_size=16, max_num_seqs=8, dtype="float32")
        params = SamplingParams(temperature=0, max_tokens=REF["max_new_tokens"], ignore_eos=True, logprobs=TOP_K)
        return llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in CASES], params, use_tqdm=False)


def test_greedy_tokens_identical(outputs):
    for case, out in zip(CASES, outputs):
        assert out.prompt_token_ids == case["prompt_token_ids"]
        assert out.outputs.token_ids == case["output_token_ids"]
        assert out.outputs.finish_reason == "length"


def test_logprobs_match(outputs):
    for case, out in zip(CASES, outputs):
        assert len(out.outputs.logprobs) == len(case["steps"])
        for step, got in zip(case["steps"], out.outputs.logprobs):
            assert got[step["token"]].logprob == pytest.approx(step["logprob"], abs=1e-3)
            for rank, (tid, want) in enumerate(step["top5"], start=1):
                assert got[tid].logprob == pytest.approx(want, abs=1e-3)
                assert got[tid].rank == rank and got[tid].decoded_token is not None
            assert got[step["token"]].rank == 1  # greedy picks the top token
