"""logprobs_mode against its definitions applied to the logits of an independent plain forward
(test_logprobs_n_stream.full_logits): raw_logits are the model's logits; processed_* are what the sampler
drew from (logit bias, then the repetition penalty over prompt and output, then for sampled rows the
temperature and top_k); prompt logprobs stay raw; the per-request transforms of raw logprobs are refused
in the other modes."""
import numpy as np
import pytest
from test_logprobs_n_stream import full_logits, log_softmax

from fastdeploy import LLM, SamplingParams

PROMPT = [17, 250, 33, 480, 91, 700, 12, 5]
BIAS = {7: 3.0, 480: -2.0}
PENALTY, TOP_K = 1.5, 5


@pytest.fixture(scope="module", params=["raw_logits", "processed_logprobs", "processed_logits"])
def llm(request, tiny_hf):
    return LLM(model=tiny_hf, block_size=16, max_num_seqs=4, dtype="float32", logprobs_mode=request.param)


def expected(mode: str, logits: np.ndarray, seen: set[int], temperature: float) -> np.ndarray:
    x = logits.copy()
    if mode.startswith("processed"):
        for token, bias in BIAS.items():
            x[token] += bias
        for token in seen:
            x[token] = x[token] / PENALTY if x[token] > 0 else x[token] * PENALTY
        if temperature > 0:
            x /= temperature
            x = np.where(x >= np.sort(x)[-TOP_K], x, -np.inf)
    return log_softmax(x) if mode.endswith("logprobs") else x


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sample_and_prompt_entries_follow_the_mode(llm, temperature):
    mode = llm.config.logprobs_mode
    params = SamplingParams(temperature=temperature, top_p=1.0, top_k=TOP_K, repetition_penalty=PENALTY, seed=3,
                            max_tokens=6, ignore_eos=True, logprobs=TOP_K, prompt_logprobs=2,
                            logits_processors_args={"logit_bias": BIAS})
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    tokens = out.outputs.token_ids
    logits = full_logits(llm, PROMPT + tokens)
    for step, (token, entry) in enumerate(zip(tokens, out.outputs.logprobs)):
        want = expected(mode, logits[len(PROMPT) - 1 + step], set(PROMPT + tokens[:step]), temperature)
        assert set(entry) == set(np.argsort(-want, kind="stable")[:TOP_K].tolist()) | {token}
        assert np.isfinite(entry[token].logprob)
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(want[tid], abs=1e-4)
    raw = log_softmax(logits) if mode.endswith("logprobs") else logits
    for i in range(1, len(PROMPT)):  # nothing processes a prompt position
        assert out.prompt_logprobs[i][PROMPT[i]].logprob == pytest.approx(raw[i - 1, PROMPT[i]], abs=1e-4)


def test_raw_logprob_transforms_are_refused_in_other_modes(llm):
    params = SamplingParams(temperature=0.8, max_tokens=2, logprobs=1, temp_scaled_logprobs=True)
    out = llm.generate([PROMPT, PROMPT], [params, SamplingParams(max_tokens=2)], use_tqdm=False)
    assert out[0].error_code != 200 and "logprobs_mode" in out[0].error_msg
    assert out[1].error_code == 200 and len(out[1].outputs.token_ids) == 2


def test_unknown_mode_is_a_value_error(tiny_hf):
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        LLM(model=tiny_hf, logprobs_mode="logits")
