"""Every documented bad input gives a clear error that names the parameter, before any work."""
import pytest

from fastdeploy import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_hf):
    return LLM(model=tiny_hf, max_model_len=64, block_size=16, max_num_seqs=4)


@pytest.mark.parametrize("kwargs, error, name", [
    ({"n": 0}, ValueError, "n"),
    ({"n": 1.5}, TypeError, "n"),
    ({"presence_penalty": 2.5}, ValueError, "presence_penalty"),
    ({"frequency_penalty": -3}, ValueError, "frequency_penalty"),
    ({"repetition_penalty": 0}, ValueError, "repetition_penalty"),
    ({"temperature": -0.1}, ValueError, "temperature"),
    ({"temperature": "hot"}, TypeError, "temperature"),
    ({"top_p": 1.2}, ValueError, "top_p"),
    ({"top_k": -2}, ValueError, "top_k"),
    ({"top_k": 2.0}, TypeError, "top_k"),
    ({"min_p": 1.5}, ValueError, "min_p"),
    ({"seed": -1}, ValueError, "seed"),
    ({"stop": 3}, TypeError, "stop"),
    ({"stop_token_ids": ["a"]}, TypeError, "stop_token_ids"),
    ({"bad_words": "word"}, TypeError, "bad_words"),
    ({"max_tokens": 0}, ValueError, "max_tokens"),
    ({"min_tokens": -1}, ValueError, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, ValueError, "min_tokens"),
    ({"logprobs": -2}, ValueError, "logprobs"),
    ({"prompt_logprobs": -2}, ValueError, "prompt_logprobs"),
    ({"reasoning_max_tokens": 10, "max_tokens": 5}, ValueError, "reasoning_max_tokens"),
])
def test_sampling_params_validation(kwargs, error, name):
    with pytest.raises(error, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, error, name", [
    ({"max_model_len": 0}, ValueError, "max_model_len"),
    ({"max_model_len": 10**9}, ValueError, "max_model_len"),
    ({"block_size": 0}, ValueError, "block_size"),
    ({"max_num_seqs": 300}, ValueError, "max_num_seqs"),
    ({"max_num_seqs": "8"}, TypeError, "max_num_seqs"),
    ({"gpu_memory_utilization": 1.5}, ValueError, "gpu_memory_utilization"),
    ({"gpu_memory_utilization": 0}, ValueError, "gpu_memory_utilization"),
    ({"num_gpu_blocks_override": 0}, ValueError, "num_gpu_blocks_override"),
    ({"kv_cache_ratio": 0}, ValueError, "kv_cache_ratio"),
    ({"max_num_batched_tokens": 16, "max_model_len": 64, "enable_chunked_prefill": False}, ValueError,
     "max_num_batched_tokens"),  # without chunking a whole prompt must fit one step
    ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, ValueError, "max_num_batched_tokens"),  # a decode each
    ({"engine_worker_queue_port": 70000}, ValueError, "engine_worker_queue_port"),
    ({"limit_mm_per_prompt": {"image": -1}}, ValueError, "limit_mm_per_prompt"),
    ({"quantization": "int3"}, ValueError, "quantization"),
    ({"seed": -5}, ValueError, "seed"),
    ({"max_logprobs": -2}, ValueError, "max_logprobs"),
    ({"reasoning_parser": "no-such-parser"}, ValueError, "ernie-x1"),
    ({"tokenizer": "/nonexistent"}, ValueError, "tokenizer"),
    ({"no_such_option": 1}, TypeError, "no_such_option"),
])
def test_llm_parameter_validation(tiny_hf, kwargs, error, name):
    with pytest.raises(error, match=name):
        LLM(model=tiny_hf, **kwargs)


def test_model_must_be_a_directory(tmp_path):
    with pytest.raises(ValueError, match="model"):
        LLM(model=str(tmp_path / "missing"))


def test_enable_mm_needs_a_multimodal_model(tiny_hf):
    with pytest.raises(ValueError, match="enable_mm"):
        LLM(model=tiny_hf, enable_mm=True)


@pytest.mark.parametrize("prompts", [3, None, [1.5], [["a"]], [{"prompt": 3}]])
def test_generate_rejects_bad_prompt_types(llm, prompts):
    with pytest.raises((TypeError, ValueError), match="prompt"):
        llm.generate(prompts, use_tqdm=False)


def test_generate_rejects_unknown_prompt_dict_keys(llm):
    with pytest.raises(ValueError, match="prompt dict keys"):
        llm.generate({"text": "hi"}, use_tqdm=False)


def test_sampling_params_list_must_match(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(TypeError, match="sampling_params"):
        llm.generate(["a"], {"temperature": 0}, use_tqdm=False)


def test_chat_rejects_bad_messages(llm):
    with pytest.raises(TypeError, match="messages"):
        llm.chat("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "hi"}], use_tqdm=False)
    with pytest.raises(TypeError, match="chat_template_kwargs"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template_kwargs=["x"], use_tqdm=False)


def test_too_long_prompt_fails_only_that_request(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7], list(range(3, 80)), [8, 9]], params, use_tqdm=False)
    assert [o.error_code for o in outputs] == [200, 400, 200]
    assert "max_model_len" in outputs[1].error_msg
    assert outputs[1].outputs.token_ids == [] and outputs[1].outputs.finish_reason == "abort"
    assert [len(o.outputs.token_ids) for o in (outputs[0], outputs[2])] == [4, 4]


@pytest.mark.parametrize("enable_mm", [None, False])
def test_media_to_a_text_only_model_fail_only_their_request(tiny_hf, llm, enable_mm):
    """Image parts in chat and multimodal_data in generate, with enable_mm left alone or set False."""
    model = llm if enable_mm is None else LLM(model=tiny_hf, max_model_len=64, enable_mm=False)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "cat.png"}},
                                          {"type": "text", "text": "what is it?"}]}]
    outputs = model.chat([image, [{"role": "user", "content": "hi"}]], params, use_tqdm=False)
    assert [o.error_code for o in outputs] == [400, 200] and len(outputs[1].outputs.token_ids) == 2
    assert "multimodal model" in outputs[0].error_msg and "image_url" in outputs[0].error_msg
    outputs = model.generate([{"prompt": "see", "multimodal_data": {"image": ["cat.png"]}}, "hi"], params,
                             use_tqdm=False)
    assert [o.error_code for o in outputs] == [400, 200] and "multimodal_data" in outputs[0].error_msg


def test_out_of_vocabulary_token_fails_only_that_request(llm):
    outputs = llm.generate([[5, 6], [10**6]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [o.error_code for o in outputs] == [200, 400]
    assert "prompt_token_ids" in outputs[1].error_msg


@pytest.mark.parametrize("field", ["stop_token_ids", "bad_words_token_ids", "logit_bias"])
def test_out_of_vocabulary_parameter_ids_fail_only_that_request(llm, field):
    vocab = llm.engine.vocab_size
    bad = {"logits_processors_args": {"logit_bias": {vocab: 5.0}}} if field == "logit_bias" else {field: [vocab]}
    good = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([[5, 6], [7, 8]], [good, SamplingParams(max_tokens=3, **bad)], use_tqdm=False)
    assert [o.error_code for o in outputs] == [200, 400]
    assert field in outputs[1].error_msg and len(outputs[0].outputs.token_ids) == 3


def test_max_tokens_is_cut_to_max_model_len(llm):
    out = llm.generate([list(range(3, 63))], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs.token_ids) == 4 and out.outputs.finish_reason == "length"


def test_numpy_token_ids_are_accepted(llm):
    import numpy as np
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    plain = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs.token_ids
    as_numpy = llm.generate([list(np.array([5, 6, 7], dtype=np.int64))], params, use_tqdm=False)[0].outputs.token_ids
    assert plain == as_numpy
