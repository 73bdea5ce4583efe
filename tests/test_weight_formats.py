"""Packed linear weights in the engine: which format each layer gets (quantization, dtype, lm_head_fp32),
that unquantized packing is exact, and that bf16 compute, wint8 and wint4 keep the demo model's greedy
choices (teacher-forced against the float32 model's own continuation)."""
from pathlib import Path

import numpy as np
import paddle
import pytest

from conftest import FIXTURES, TINY_HF
from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.layers.packed import named_slots
from fastdeploy.model_executor.load import Checkpoint, load_model
from fastdeploy.model_executor.weight_format import named_weights, weight_bytes

DEMO = Path(__file__).parents[1] / "models" / "ernie-4.5-demo"
MOE = FIXTURES / "models" / "ernie45_moe_tiny_hf"
QWEN3_MOE = FIXTURES / "models" / "qwen3_moe_tiny"  # no shared experts or correction bias, untied head


def packed_formats(llm: LLM) -> dict[str, str]:
    """Format of every packed weight by name, and of the LM head ("lm_head", tied or not)."""
    model = llm.engine.runner.model
    formats = {name: slot.target.value.fmt for name, slot in named_slots(model)}
    return formats | {"lm_head": model.lm_head.packed.fmt}


def test_unquantized_bf16_checkpoint_packs_exactly():
    llm = LLM(model=str(TINY_HF), max_model_len=256)
    assert set(packed_formats(llm).values()) == {"bf16"}  # the fixture stores bf16
    packed = named_weights(llm.engine.runner.model)
    with Checkpoint(str(TINY_HF)) as ckpt:  # HF layout: [out, in], q/k/v and gate/up separate
        raw = {name: ckpt.read(name) for name in ckpt.tensors}
    np.testing.assert_array_equal(packed["model.embed_tokens.weight"], raw["model.embed_tokens.weight"])
    for i in range(2):
        p = f"model.layers.{i}."
        qkv = np.concatenate([raw[p + f"self_attn.{n}_proj.weight"].T for n in "qkv"], axis=1)
        np.testing.assert_array_equal(packed[p + "self_attn.qkv_proj.weight"], qkv)
        np.testing.assert_array_equal(packed[p + "mlp.down_proj.weight"], raw[p + "mlp.down_proj.weight"].T)
    # The tied LM head multiplies by the embedding's own bytes: one table.
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("model", [MOE, QWEN3_MOE], ids=lambda p: p.name)
@pytest.mark.parametrize("quantization, body", [("wint8", "int8"), ("wint4", "int4")])
def test_quantization_formats_per_layer(quantization, body, model):
    llm = LLM(model=str(model), max_model_len=256, quantization=quantization)
    formats = packed_formats(llm)
    for name, fmt in formats.items():
        if name.endswith("mlp.gate.weight"):
            assert fmt == "fp32", name  # the router is never quantized: routing is computed in float32
        elif name in ("lm_head", "lm_head.weight", "model.embed_tokens.weight"):
            assert fmt == "int8"  # the vocabulary tables
        else:
            assert fmt == body, name
    assert any(".experts." in n for n in formats) and any(n.endswith("mlp.gate.weight") for n in formats)


def test_dtype_and_lm_head_fp32_choose_the_formats():
    as_stored = packed_formats(LLM(model=str(MOE), max_model_len=256))
    fp32 = LLM(model=str(MOE), max_model_len=256, dtype="float32")
    assert set(packed_formats(fp32).values()) == {"fp32"}
    assert fp32.engine.runner.kv_caches[0].dtype == paddle.float32  # the KV cache in the compute precision
    assert {f for n, f in as_stored.items() if not n.endswith("mlp.gate.weight")} == {"bf16"}  # stored bf16
    bf16 = LLM(model=str(MOE), max_model_len=256, dtype="bf16")
    assert packed_formats(bf16) == as_stored
    assert bf16.engine.runner.kv_caches[0].dtype == paddle.bfloat16
    assert bf16.engine.runner.kv_block_bytes * 2 == fp32.engine.runner.kv_block_bytes
    # float32 holds the stored bf16 values exactly
    bf16_weights = named_weights(LLM(model=str(MOE), max_model_len=256).engine.runner.model)
    for name, w in named_weights(fp32.engine.runner.model).items():
        np.testing.assert_array_equal(w, bf16_weights[name], err_msg=name)
    head = packed_formats(LLM(model=str(MOE), max_model_len=256, quantization="wint8", lm_head_fp32=True))
    assert head["lm_head"] == head["model.embed_tokens.weight"] == "fp32"
    assert {f for n, f in head.items() if ".experts." in n} == {"int8"}


@pytest.mark.parametrize("quantization", ["wint8", "wint4"])
def test_quantized_weights_within_a_quantization_step(quantization):
    """Dequantized weights are within half a step of the loaded ones (int4: one step where the group's
    largest value of the other sign rounds to +8 and clips to 7), with the mean error of rounding."""
    config = ModelConfig.from_pretrained(str(TINY_HF))
    loaded = named_weights(load_model(config))  # bf16 as stored: exact
    llm = LLM(model=str(TINY_HF), max_model_len=256, quantization=quantization)
    model = llm.engine.runner.model
    for name, slot in named_slots(model):
        if slot.target.role == "table":
            continue
        w, q = loaded[name], slot.dense()
        if quantization == "wint8":  # one scale per output column
            step = np.broadcast_to(np.abs(w).max(axis=0) / 127, w.shape)
        else:  # one scale per 128 rows (zero-padded) per column
            rows = -(-w.shape[0] // 128) * 128
            padded = np.concatenate([np.abs(w), np.zeros((rows - w.shape[0], w.shape[1]), w.dtype)])
            step = np.repeat(padded.reshape(-1, 128, w.shape[1]).max(axis=1) / 8, 128, axis=0)[:w.shape[0]]
        err = np.abs(q - w)
        bound = step / 2 if quantization == "wint8" else step
        assert np.all(err <= bound * (1 + 1e-5)), name
        assert 0.15 < err.mean() / step.mean() < 0.35, name  # rounding error is uniform: mean step / 4
    fp = weight_bytes(LLM(model=str(TINY_HF), max_model_len=256).engine.runner.model)
    assert weight_bytes(model) < fp  # fewer bytes than bf16 for the packed layers


def teacher_forced(llm: LLM, seqs: list[list[int]], starts: list[int]) -> tuple[list[int], list[float]]:
    """At each continuation position: the model's top-1 token and its logprob of the given token."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    tops, logprobs = [], []
    for seq, start, out in zip(seqs, starts, outs):
        for pos in range(start, len(seq)):
            entry = out.prompt_logprobs[pos]
            tops.append(min(entry, key=lambda t: entry[t].rank))
            logprobs.append(entry[seq[pos]].logprob)
    return tops, logprobs


@pytest.mark.parametrize("quantization, min_agreement, max_dlogprob", [
    (None, 0.99, 0.005), ("wint8", 0.97, 0.015), ("wint4", 0.93, 0.06),
    ({"kv_cache_quant_type": "block_wise_fp8"}, 0.99, 0.015)])
def test_quantized_demo_model_keeps_greedy_choices(quantization, min_agreement, max_dlogprob):
    """None: the stored bf16 weights with bf16 matmul inputs (dtype "auto"), against float32 compute; the
    last case those weights with an fp8 KV cache (the teacher-forced prompt reads its keys and values back
    from the cache, quantized)."""
    prompts = ["The Python tutorial", "def main():", "import os\n", "A list is", "The sys module",
               "Exceptions are", "for i in range", "class Foo:"]
    base = LLM(model=str(DEMO), max_model_len=256, dtype="float32")
    outs = base.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs.token_ids for o in outs]
    starts = [len(o.prompt_token_ids) for o in outs]
    want = [t for s, start in zip(seqs, starts) for t in s[start:]]
    base_tops, base_lp = teacher_forced(base, seqs, starts)
    assert base_tops == want  # the unquantized model's greedy choice at every position
    tops, lp = teacher_forced(LLM(model=str(DEMO), max_model_len=256, quantization=quantization), seqs, starts)
    agreement = np.mean(np.array(tops) == np.array(want))
    assert agreement >= min_agreement
    assert np.mean(np.abs(np.array(lp) - np.array(base_lp))) <= max_dlogprob
