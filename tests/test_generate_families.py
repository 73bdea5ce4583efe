"""LLM.generate reproduces transformers' greedy continuations and logprobs (committed JSON made by
tools/make_model_reference.py) for ERNIE-4.5 MoE in both checkpoint layouts, Qwen2, Qwen3, Qwen3-MoE, Llama 3
and Mistral, all prompts of a model batched together; the MoE models, Qwen3 and Llama 3 also with the ops'
pure-Paddle references."""
import json

import pytest

from conftest import FIXTURES, REFERENCE, compiled_ops
from fastdeploy import LLM, SamplingParams

# fixture directory -> reference file
FAMILIES = {
    "ernie45_moe_tiny_hf": "ernie45_moe_tiny_greedy.json",
    "ernie45_moe_tiny_paddle": "ernie45_moe_tiny_greedy.json",
    "qwen2_tiny": "qwen2_tiny_greedy.json",
    "qwen3_tiny": "qwen3_tiny_greedy.json",
    "qwen3_moe_tiny": "qwen3_moe_tiny_greedy.json",
    "llama3_tiny": "llama3_tiny_greedy.json",
    "mistral_tiny": "mistral_tiny_greedy.json",
}
TOL = 1e-3


@pytest.fixture(scope="module", params=[(f, True) for f in FAMILIES] + [("ernie45_moe_tiny_hf", False),
                                                                          ("qwen3_tiny", False),
                                                                          ("qwen3_moe_tiny", False),
                                                                          ("llama3_tiny", False)],
                ids=list(FAMILIES) + ["ernie45_moe_tiny_hf-reference-ops", "qwen3_tiny-reference-ops",
                                      "qwen3_moe_tiny-reference-ops", "llama3_tiny-reference-ops"])
def run(request):
    fixture, compiled = request.param
    ref = json.loads((REFERENCE / FAMILIES[fixture]).read_text())
    with compiled_ops(compiled):
        llm = LLM(model=str(FIXTURES / "models" / fixture), block_size=16, max_num_seqs=8, dtype="float32")
        params = SamplingParams(temperature=0, max_tokens=ref["max_new_tokens"], ignore_eos=True,
                                logprobs=ref["top_k"])
        outputs = llm.generate([{"prompt_token_ids": c["prompt_token_ids"]} for c in ref["cases"]], params,
                               use_tqdm=False)
    return ref["cases"], outputs


def test_greedy_tokens_identical(run):
    cases, outputs = run
    assert len(outputs) == len(cases)
    for case, out in zip(cases, outputs):
        assert out.prompt_token_ids == case["prompt_token_ids"]
        assert out.outputs.token_ids == case["output_token_ids"]
        assert out.outputs.finish_reason == "length"


def test_logprobs_match(run):
    cases, outputs = run
    for case, out in zip(cases, outputs):
        assert len(out.outputs.logprobs) == len(case["steps"])
        for step, got in zip(case["steps"], out.outputs.logprobs):
            assert got[step["token"]].logprob == pytest.approx(step["logprob"], abs=TOL)
            assert got[step["token"]].rank == 1  # greedy picks the top token
            values = [lp for _, lp in step["top5"]]
            for rank, (tid, want) in enumerate(step["top5"], start=1):
                assert got[tid].logprob == pytest.approx(want, abs=TOL)
                assert got[tid].decoded_token is not None
                # Ranks are the reference's, except among entries closer than float32 rounding.
                tied = [r for r, v in enumerate(values, start=1) if abs(v - want) < TOL]
                assert got[tid].rank in tied, (tid, got[tid].rank, rank)
