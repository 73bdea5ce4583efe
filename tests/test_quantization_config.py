"""The `quantization` argument in FastDeploy's forms (a name, a dict, a JSON string; mix_quant and
kv_cache_quant_type) and what each does to the loaded model and its KV cache."""
from __future__ import annotations

import json

import numpy as np
import paddle
import pytest

from conftest import FIXTURES, TINY_HF
from fastdeploy import LLM, SamplingParams
from fastdeploy.entrypoints.openai.cli_args import engine_config, make_parser
from fastdeploy.model_executor.quantization import QuantConfig, parse_quantization
from test_weight_formats import QWEN3_MOE, packed_formats

MOE = FIXTURES / "models" / "ernie45_moe_tiny_hf"
MIX = {"quantization": "mix_quant", "dense_quant_type": "wint8", "moe_quant_type": "wint4",
       "kv_cache_quant_type": "block_wise_fp8"}


@pytest.mark.parametrize("given, expected", [
    (None, QuantConfig()),
    ("wint4", QuantConfig("wint4")),
    ({"quantization": "wint8"}, QuantConfig("wint8")),
    ('{"quantization": "wint8", "kv_cache_quant_type": "block_wise_fp8"}',
     QuantConfig("wint8", None, "block_wise_fp8")),
    (MIX, QuantConfig("wint8", "wint4", "block_wise_fp8")),
    (json.dumps(MIX), QuantConfig("wint8", "wint4", "block_wise_fp8")),
    ({"kv_cache_quant_type": "block_wise_fp8"}, QuantConfig(None, None, "block_wise_fp8")),
    (dict(MIX, kv_cache_quant_type=None, is_permuted=True, image_moe_quant_type="wint4"),
     QuantConfig("wint8", "wint4")),
])
def test_forms_of_the_quantization_argument(given, expected):
    assert parse_quantization(given) == expected


@pytest.mark.parametrize("given, error, match", [
    ("int3", ValueError, "quantization must be"),
    ("{not json", ValueError, "not valid JSON"),
    (3, TypeError, "quantization must be"),
    ({"quantization": "mix_quant", "dense_quant_type": "wint8"}, ValueError, "moe_quant_type"),
    (dict(MIX, moe_quant_type="int4"), ValueError, "moe_quant_type"),
    (dict(MIX, kv_cache_quant_type="fp16"), ValueError, "kv_cache_quant_type"),
    (dict(MIX, kv_cache_quant_type="int8"), NotImplementedError, "calibrated"),
    (dict(MIX, is_quantized=True), NotImplementedError, "is_quantized"),
    (dict(MIX, image_moe_quant_type="wint8"), NotImplementedError, "image_moe_quant_type"),
    (dict(MIX, surprise=1), ValueError, "surprise"),
    ({"quantization": "wint8", "moe_quant_type": "wint4"}, ValueError, "mix_quant"),
    ("w4a8", NotImplementedError, "w4a8"),
])
def test_bad_quantization_is_refused_by_name(given, error, match):
    with pytest.raises(error, match=match):
        parse_quantization(given)
    with pytest.raises(error, match=match):
        LLM(model=str(TINY_HF), quantization=given)


@pytest.mark.parametrize("model", [MOE, QWEN3_MOE], ids=lambda p: p.name)
def test_mix_quant_packs_experts_and_dense_layers_apart(model):
    formats = packed_formats(LLM(model=str(model), max_model_len=256, quantization=MIX))
    experts = {fmt for name, fmt in formats.items() if ".experts." in name and "shared" not in name}
    dense = {fmt for name, fmt in formats.items() if "self_attn" in name or "shared_experts" in name
             or name.endswith("mlp.up_gate_proj.weight") or name.endswith("mlp.down_proj.weight")}
    assert experts == {"int4"} and dense == {"int8"}
    assert formats["lm_head"] == "int8"


def test_fp8_kv_cache_holds_a_byte_and_a_row_scale_per_value():
    """The cache is uint8 rows of head_dim codes plus 4 scale bytes, and the memory budget counts those bytes."""
    fp8 = LLM(model=str(TINY_HF), max_model_len=256, quantization={"kv_cache_quant_type": "block_wise_fp8"})
    runner = fp8.engine.runner
    mc = fp8.config.model_config
    assert fp8.config.kv_cache_dtype == "block_wise_fp8"
    assert all(c.dtype == paddle.uint8 and c.shape[-1] == mc.head_dim + 4 for c in runner.kv_caches)
    bf16 = LLM(model=str(TINY_HF), max_model_len=256).engine.runner
    assert bf16.kv_caches[0].dtype == paddle.bfloat16
    ratio = runner.kv_block_bytes / bf16.kv_block_bytes
    assert ratio == (mc.head_dim + 4) / (2 * mc.head_dim)


def test_fp8_kv_cache_serves_batches_as_one_request_at_a_time():
    """Batching, chunked prefill and prefix caching over an fp8 cache: each request's greedy tokens are the
    ones it gets alone."""
    llm = LLM(model=str(MOE), max_model_len=256, max_num_seqs=4, enable_chunked_prefill=True,
              max_num_batched_tokens=32, quantization=MIX)
    prompts = [[5 + i, 17, 40 + 3 * i, 9, 11] * (4 + i) for i in range(5)] + [[5, 17, 40, 9, 11] * 4 + [7, 7]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = [o.outputs.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs.token_ids for p in prompts]
    assert together == alone
    assert all(len(t) == 12 for t in together)
    assert not np.all([a == b for a, b in zip(together[1:], together[:-1])])


def test_server_takes_the_json_form():
    args = make_parser().parse_args(["--model", str(TINY_HF), "--max-model-len", "64",
                                     "--quantization", json.dumps(MIX)])
    assert engine_config(args).quant == QuantConfig("wint8", "wint4", "block_wise_fp8")


def test_fp8_kv_cache_under_tensor_parallel():
    """Each rank holds its kv heads' fp8 rows; two ranks give one rank's tokens and close logprobs (the
    weights kept bf16: quantized activations differ with the rank split, and this random model's tokens with them)."""
    prompts = [[5 + i, 17, 40 + 3 * i, 9, 11] * 5 for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    runs = []
    for size in (1, 2):
        llm = LLM(model=str(MOE), max_model_len=128, tensor_parallel_size=size,
                  quantization={"kv_cache_quant_type": "block_wise_fp8"})
        runs.append(llm.generate(prompts, params, use_tqdm=False))
        del llm
    for one, two in zip(*runs):
        assert one.outputs.token_ids == two.outputs.token_ids
        for a, b, t in zip(one.outputs.logprobs, two.outputs.logprobs, one.outputs.token_ids):
            assert abs(a[t].logprob - b[t].logprob) < 1e-3
