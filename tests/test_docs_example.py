"""The offline-inference example of FastDeploy's documentation, unchanged but for the model path."""
from fastdeploy import LLM, SamplingParams


def test_documentation_example_runs(tiny_hf):
    prompts = ["把李白的静夜思改写为现代诗", "Write me a poem about large language model."]
    sampling_params = SamplingParams(top_p=0.95, max_tokens=6400)
    llm = LLM(model=tiny_hf, tensor_parallel_size=1, max_model_len=8192)
    outputs = llm.generate(prompts, sampling_params)
    assert len(outputs) == 2
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs.text
        assert prompt in prompts and isinstance(generated_text, str) and output.finished
        assert output.outputs.finish_reason in ("stop", "length")
        assert 1 <= len(output.outputs.token_ids) <= 6400

    msg1 = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello!"}]
    msg2 = [{"role": "user", "content": "Write a haiku."}]
    outputs = llm.chat([msg1, msg2], SamplingParams(top_p=0.95, max_tokens=64))
    assert [o.prompt.startswith("<|begin_of_sentence|>") for o in outputs] == [True, True]
    assert all(o.metrics.inference_start_time >= o.metrics.arrival_time and o.metrics.first_token_time >= 0
               for o in outputs)
