"""Llama 3.x / Mistral specifics against transformers (tests/fixtures/reference/llama3_tiny_greedy.json, made by
tools/make_model_reference.py): Llama 3.1's scaled inverse frequencies, the variant with attention and MLP
biases, a tied head and plain rope, and the config rules (rope types, Mistral's sliding window against
max_model_len, tie_word_embeddings' default). The common checks (teacher forced, KV cache, batched chunks)
run these fixtures in test_model_families.py."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from fastdeploy import ops
from fastdeploy.config import EngineConfig
from fastdeploy.model_executor.layers.rotary import llama3_inv_freq, rope_inv_freq
from fastdeploy.model_executor.model_config import Llama3RopeScaling, ModelConfig
from test_ernie45_parity import Runner, check_prefill_then_decode
from test_model_families import MODELS, REFS, assert_matches, check_teacher_forced, load, write_variant

LLAMA = MODELS / "llama3_tiny"
MISTRAL = MODELS / "mistral_tiny"
REF = REFS["llama3_tiny_greedy.json"]


def scaling_of(params: dict) -> Llama3RopeScaling:
    return Llama3RopeScaling(params["factor"], params["low_freq_factor"], params["high_freq_factor"],
                             params["original_max_position_embeddings"])


@pytest.mark.parametrize("case", REF["rope"], ids=lambda c: c["name"])
def test_llama3_inverse_frequencies_match_transformers(case: dict) -> None:
    default = np.asarray(case["default_inv_freq"], np.float32)
    expected = np.asarray(case["inv_freq"], np.float32)
    params = case["rope_parameters"]
    # The scaling is transformers' float32 operations in order: the same bits from the same plain table.
    np.testing.assert_array_equal(llama3_inv_freq(default, scaling_of(params)), expected)
    # The plain table (numpy's float32 power, torch's differs in the last bit for some entries) and so the
    # whole table agree to rounding.
    ours = ops.default_inv_freq(case["head_dim"], params["rope_theta"])
    np.testing.assert_allclose(ours, default, rtol=2.5e-7, atol=0)
    np.testing.assert_allclose(llama3_inv_freq(ours, scaling_of(params)), expected, rtol=2.5e-7, atol=0)


def test_fixture_rope_scaling_uses_every_band_and_reaches_the_model() -> None:
    case = REF["rope"][0]
    assert case["name"] == "llama3_tiny"
    default, scaled = np.asarray(case["default_inv_freq"]), np.asarray(case["inv_freq"])
    factor = case["rope_parameters"]["factor"]
    kept, divided = np.isclose(scaled, default, rtol=1e-6), np.isclose(scaled, default / factor, rtol=1e-6)
    between = ~kept & ~divided & (scaled < default) & (scaled > default / factor)
    assert kept.sum() >= 1 and divided.sum() >= 1 and between.sum() >= 1 and (kept | divided | between).all()
    config = ModelConfig.from_pretrained(LLAMA)
    assert config.rope_scaling == scaling_of(case["rope_parameters"]) and config.rope_theta == 500000.0
    np.testing.assert_allclose(load(LLAMA).model.rotary.inv_freq, scaled, rtol=2.5e-7, atol=0)


def test_plain_rope_would_not_reproduce_the_reference(tmp_path: Path) -> None:
    """The reference depends on the scaling: the same weights with plain rope give other logprobs."""
    model = load(write_variant(tmp_path, LLAMA, {"rope_scaling": None}))
    case = REF["cases"][4]  # 64 prompt tokens, past original_max_position_embeddings (32)
    logprobs = Runner(model).step({0: case["prompt_token_ids"] + case["output_token_ids"][:-1]})[0]
    n = len(case["prompt_token_ids"])
    diffs = [abs(logprobs[n - 1 + j][s["token"]] - s["logprob"]) for j, s in enumerate(case["steps"])]
    assert max(diffs) > 0.05


def test_llama_bias_variant_tied_plain_rope(tmp_path: Path) -> None:
    variant = REF["bias_variant"]
    biases = {n: np.asarray(v, np.float32) for n, v in variant["biases"].items()}
    assert len(biases) == 7 * 2  # q, k, v, o, gate, up and down of each layer
    assert variant["dropped"] == ["lm_head.weight"]  # a tied checkpoint
    model = load(write_variant(tmp_path, LLAMA, variant["config"], extra=biases, drop="lm_head.weight"))
    layer = model.model.layers[0]
    assert model.lm_head.tied and model.config.rope_scaling is None
    assert layer.self_attn.o_proj.bias is not None and layer.mlp.down_proj.bias is not None
    for case in variant["cases"]:
        check_teacher_forced(model, case, "llama with attention_bias, mlp_bias, tied, plain rope")
        check_prefill_then_decode(model, {**case, "prompt_logprobs": None}, assert_matches)


def test_layouts_and_defaults() -> None:
    llama, mistral = load(LLAMA), load(MISTRAL)
    assert not llama.lm_head.tied and not mistral.lm_head.tied
    attn = llama.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (6, 2, 24) and attn.qkv_proj.bias is None
    assert llama.model.layers[0].mlp.up_gate_proj.bias is None and attn.o_proj.bias is None
    assert mistral.config.sliding_window is None and mistral.config.rope_scaling is None
    np.testing.assert_array_equal(mistral.model.rotary.inv_freq, ops.default_inv_freq(16, 1e6))


def with_config(tmp_path: Path, source: Path, **changes: object) -> Path:
    """`source`'s config with `changes` (None removes a field) and its tokenizer, no weights."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, tmp_path / name)
    config = json.loads((source / "config.json").read_text())
    merged = {**config, **changes}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in merged.items() if v is not None}))
    return tmp_path


def test_rope_config_forms(tmp_path: Path) -> None:
    """rope_scaling (transformers 4, as Llama-3.1's config.json), its old `type` key and rope_parameters
    (transformers 5, rope_theta inside) give the same scaling; no scaling or rope_type default is plain rope."""
    scaling = dict(json.loads((LLAMA / "config.json").read_text())["rope_scaling"])
    expected = scaling_of(scaling)
    old_key = {**{k: v for k, v in scaling.items() if k != "rope_type"}, "type": "llama3"}
    v5 = {**scaling, "rope_theta": 500000.0}
    for changes in ({}, {"rope_scaling": old_key}, {"rope_scaling": None, "rope_theta": None, "rope_parameters": v5}):
        config = ModelConfig.from_pretrained(with_config(tmp_path, LLAMA, **changes))
        assert (config.rope_scaling, config.rope_theta) == (expected, 500000.0), changes
    # Without original_max_position_embeddings transformers takes max_position_embeddings.
    no_original = {k: v for k, v in scaling.items() if k != "original_max_position_embeddings"}
    config = ModelConfig.from_pretrained(with_config(tmp_path, LLAMA, rope_scaling=no_original))
    assert config.rope_scaling.original_max_position_embeddings == 131072
    for changes in ({"rope_scaling": None}, {"rope_scaling": {"rope_type": "default"}},
                    {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}):
        config = ModelConfig.from_pretrained(with_config(tmp_path, LLAMA, **changes))
        assert config.rope_scaling is None and config.rope_theta == 500000.0
        np.testing.assert_array_equal(rope_inv_freq(config), ops.default_inv_freq(24, 500000.0))


@pytest.mark.parametrize("changes, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"field 'rope_scaling.rope_type' is 'yarn'; supported rope types: 'default', 'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"field 'rope_scaling.type' is 'linear'; supported"),
    ({"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     r"field 'rope_parameters.rope_type' is 'dynamic'; supported rope types: 'default', 'llama3'"),
    ({"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     r"required field 'rope_scaling.factor' is missing"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}},
     r"'rope_scaling.high_freq_factor' \(4.0\) must exceed 'rope_scaling.low_freq_factor' \(4.0\)"),
    ({"rope_scaling": [8.0]}, r"field 'rope_scaling' must be an object or null"),
])
def test_rope_config_rejections(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(with_config(tmp_path, LLAMA, **changes))


def test_mistral_sliding_window_against_max_model_len(tmp_path: Path) -> None:
    """A window covering max_model_len is full causal attention, so it runs; a shorter one is refused before
    anything loads. transformers' MistralConfig gives a config without the field a 4096 window."""
    assert EngineConfig(model=str(with_config(tmp_path, MISTRAL, sliding_window=64)), max_model_len=64)
    with pytest.raises(ValueError, match=r"sliding_window \(64\) is shorter than max_model_len \(65\)"):
        EngineConfig(model=str(tmp_path), max_model_len=65)
    default = with_config(tmp_path, MISTRAL, sliding_window=None)  # field absent
    assert ModelConfig.from_pretrained(default).sliding_window == 4096
    with pytest.raises(ValueError, match=r"sliding_window \(4096\) is shorter than max_model_len \(8192\)"):
        EngineConfig(model=str(default), max_model_len=8192)
    with pytest.raises(ValueError, match="field 'sliding_window' must be a positive integer or null"):
        ModelConfig.from_pretrained(with_config(tmp_path, MISTRAL, sliding_window=0))
    # Llama has no window: the same field on a Llama config is not read (as transformers' LlamaConfig).
    assert ModelConfig.from_pretrained(with_config(tmp_path, LLAMA, sliding_window=16)).sliding_window is None


def test_tie_word_embeddings_defaults_to_false(tmp_path: Path) -> None:
    """transformers' LlamaConfig and MistralConfig default tie_word_embeddings to false."""
    for source in (LLAMA, MISTRAL):
        target = tmp_path / source.name
        target.mkdir()
        assert ModelConfig.from_pretrained(with_config(target, source, tie_word_embeddings=None)).tie_word_embeddings \
            is False


def test_benchmark_shape_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    """tools/random_checkpoint.py's llama family (the llama-3.1-8b benchmark shape), shrunk: untied head and
    Llama 3.1's rope scaling as its config.json has them; the loader takes all of its tensors."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from random_checkpoint import SHAPES, ModelShape, write_checkpoint
    real = SHAPES["llama-3.1-8b"]
    assert (real.hidden, real.layers, real.heads, real.kv_heads, real.head_dim, real.ffn, real.vocab) == (
        4096, 32, 32, 8, 128, 14336, 128256)
    shape = ModelShape("llama", vocab=1024, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=96)
    write_checkpoint(tmp_path / "ckpt", shape, 2, progress=False)
    model = load(tmp_path / "ckpt")
    assert not model.lm_head.tied and len(model.model.layers) == 2
    assert (model.config.rope_scaling, model.config.rope_theta) == (Llama3RopeScaling(8.0, 1.0, 4.0, 8192), 500000.0)
