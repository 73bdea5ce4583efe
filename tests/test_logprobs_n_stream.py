"""Logprobs against an independent log-softmax, prompt logprobs against transformers, n > 1, and
streaming deltas against the non-streamed outputs."""
import json

import numpy as np
import paddle
import pytest

from conftest import REFERENCE
from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.forward_context import allocate_kv_caches, build_forward_context, forward_context
from fastdeploy.sampling.logprobs import log_softmax as runner_log_softmax

PROMPTS = [[17, 250, 33, 480, 91, 700, 12, 5], [9, 8, 7], list(range(40, 75))]


@pytest.fixture(scope="module")
def llm(tiny_hf):
    return LLM(model=tiny_hf, block_size=16, max_num_seqs=8, dtype="float32")  # compared with transformers' float32


def full_logits(llm, tokens):
    """Logits at every position from one plain forward of the whole sequence in a fresh cache (of the
    engine's KV dtype)."""
    model = llm.engine.runner.model
    mc = llm.config.model_config
    blocks = -(-len(tokens) // 16)
    caches = allocate_kv_caches(mc.num_hidden_layers, blocks, 16, mc.num_key_value_heads, mc.head_dim,
                                llm.config.kv_cache_dtype)
    ctx = build_forward_context([len(tokens)], [len(tokens)], [list(range(blocks))], 16, caches)
    with paddle.no_grad(), forward_context(ctx):
        hidden = model(paddle.to_tensor(tokens, dtype="int64"), paddle.arange(len(tokens), dtype="int64"))
        return model.compute_logits(hidden).numpy().astype(np.float64)


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_log_softmax_is_exact_far_below_the_maximum():
    """Paddle's CPU log_softmax floors values at about -64; the runner's must not."""
    logits = np.array([[0.0, -100.0, -np.inf, 3.0, -70.0], [5.0, 4.0, 3.0, -1e4, 0.0]], dtype=np.float32)
    got = runner_log_softmax(logits)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, log_softmax(logits.astype(np.float64)), rtol=1e-6)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_sample_logprobs_equal_independent_log_softmax(llm, k):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True, logprobs=k)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        tokens = out.outputs.token_ids
        logp = log_softmax(full_logits(llm, prompt + tokens))[len(prompt) - 1:-1]
        assert len(out.outputs.logprobs) == len(tokens)
        for step, (token, entry) in enumerate(zip(tokens, out.outputs.logprobs)):
            order = np.argsort(-logp[step], kind="stable")
            expected = set(order[:k].tolist()) | {token}
            assert set(entry) == expected
            for tid, lp in entry.items():
                assert lp.logprob == pytest.approx(logp[step, tid], abs=1e-4)
                assert lp.rank == int((logp[step] > logp[step, tid] + 1e-6).sum()) + 1  # 1-based
                assert lp.decoded_token == llm.get_tokenizer().decode([tid], skip_special_tokens=False)


def test_prompt_logprobs_match_transformers(llm):
    ref = json.loads((REFERENCE / "ernie45_tiny_greedy.json").read_text())
    cases = [c for c in ref["cases"] if c.get("prompt_logprobs")]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    outs = llm.generate([c["prompt_token_ids"] for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(case["prompt_token_ids"])
        for want, got in zip(case["prompt_logprobs"][1:], out.prompt_logprobs[1:]):
            assert got[want["token"]].logprob == pytest.approx(want["logprob"], abs=1e-3)
            for rank, (tid, lp) in enumerate(want["top5"], start=1):
                assert got[tid].logprob == pytest.approx(lp, abs=1e-3) and got[tid].rank == rank


def test_prompt_logprobs_survive_chunked_prefill(tiny_hf):
    prompt = list(range(3, 70))
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    whole = LLM(model=tiny_hf, block_size=16).generate([prompt], params, use_tqdm=False)[0]
    chunked = LLM(model=tiny_hf, block_size=16, enable_chunked_prefill=True,
                  max_num_batched_tokens=16).generate([prompt], params, use_tqdm=False)[0]
    assert len(chunked.prompt_logprobs) == len(prompt)
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)


def test_n_samples_are_reproducible_and_differ(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert len(first) == 8
    assert [o.outputs.index for o in first] == list(range(8))
    assert [o.prompt_token_ids for o in first] == [PROMPTS[0]] * 4 + [PROMPTS[1]] * 4
    samples = [tuple(o.outputs.token_ids) for o in first[:4]]
    assert len(set(samples)) > 1
    # Same seed, different company: the same samples.
    again = llm.generate([PROMPTS[2], PROMPTS[0]], [SamplingParams(temperature=0.5, max_tokens=5), params],
                         use_tqdm=False)
    assert [tuple(o.outputs.token_ids) for o in again[1:]] == samples


def test_n_samples_share_prompt_blocks(tiny_hf):
    llm = LLM(model=tiny_hf, block_size=16, enable_prefix_caching=True)
    prompt = list(range(100, 150))  # 3 full blocks + 2 tokens
    outs = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4), use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 48, 48]


def join_stream(chunks, count):
    tokens, texts, finished = [[] for _ in range(count)], [""] * count, [None] * count
    for chunk in chunks:
        assert len(chunk) == count
        for i, out in enumerate(chunk):
            if out is None:
                continue
            assert finished[i] is None, "nothing may follow a finished output"
            tokens[i] += out.outputs.token_ids
            texts[i] += out.outputs.text
            if out.finished:
                finished[i] = out.outputs.finish_reason
    return tokens, texts, finished


def test_stream_deltas_join_to_full_outputs(llm):
    full = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    stops = [full[0].outputs.text[12:16], "\x00never", full[2].outputs.text[3:5]]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=s) for s in stops]
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens, texts, finished = join_stream(llm.generate(PROMPTS, params, use_tqdm=False, stream=True), 3)
    assert tokens == [o.outputs.token_ids for o in expected]
    assert texts == [o.outputs.text for o in expected]
    assert finished == [o.outputs.finish_reason for o in expected] == ["stop", "length", "stop"]
    for text, stop in zip(texts, stops):
        assert stop not in text


def test_chat_stream_and_rejected_request(llm):
    conversations = [[{"role": "user", "content": "hello there"}], [{"role": "user", "content": "x " * 3000}]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = llm.chat(conversations, params, use_tqdm=False)
    assert [o.error_code for o in expected] == [200, 400]
    tokens, texts, finished = join_stream(llm.chat(conversations, params, use_tqdm=False, stream=True), 2)
    assert tokens[0] == expected[0].outputs.token_ids and texts[0] == expected[0].outputs.text
    assert finished == ["length", "abort"]


def test_dropping_a_stream_frees_the_engine(llm):
    stream = llm.generate(PROMPTS, SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False, stream=True)
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.runner.num_blocks
