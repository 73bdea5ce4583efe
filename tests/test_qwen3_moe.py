"""Qwen3-MoE specifics against transformers (tests/fixtures/reference/qwen3_moe_tiny_greedy.json, made by
tools/make_model_reference.py): which layers are MoE (decoder_sparse_step, mlp_only_layers, num_experts 0),
`norm_topk_prob` false, the config spelling transformers 5 writes, and the settings the model refuses.
Greedy parity on every path is in the shared family tables: test_model_families.py (teacher-forced,
prefill then decode, batched chunked), test_generate_families.py, test_tensor_parallel.py,
test_compiled_step.py (bf16 / wint8 / wint4), test_shape_sweep.py (a numpy reference of any shape)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from conftest import FIXTURES, REFERENCE
from fastdeploy import ops
from fastdeploy.distributed.parallel_state import check_tp_size
from fastdeploy.model_executor.layers.linear import GatedMLP
from fastdeploy.model_executor.layers.moe import SparseMoE
from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.models.qwen3_moe import Qwen3MoeSettings
from fastdeploy.model_executor.models.registry import get_model_class, supported_architectures
from fastdeploy.model_executor.weight_format import named_weights
from test_model_families import check_teacher_forced, load, write_variant
from test_moe_op import make_layer

MODEL = FIXTURES / "models" / "qwen3_moe_tiny"
REF = json.loads((REFERENCE / "qwen3_moe_tiny_greedy.json").read_text())
CONFIG = json.loads((MODEL / "config.json").read_text())


def write_config(directory: Path, **changes: object) -> Path:
    """The fixture's config.json with `changes` (None removes a field), alone in `directory`."""
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(
        {k: v for k, v in {**CONFIG, **changes}.items() if v is not None}))
    return directory


def test_reference_exercises_the_routing() -> None:
    """No router's k-th choice is within float32 rounding of the next one, and norm_topk_prob false changes
    the continuations (so the variant checks something the main cases do not)."""
    for routing in (REF["routing"], REF["norm_topk_prob_variant"]["routing"]):
        assert routing["min_topk_margin"] > 1e-5 and routing["choices"] > 1000
    main = {tuple(c["prompt_token_ids"]): c["output_token_ids"] for c in REF["cases"]}
    for case in REF["norm_topk_prob_variant"]["cases"]:
        tokens = case["output_token_ids"]
        assert tokens != main[tuple(case["prompt_token_ids"])][:len(tokens)]


def test_layer_placement_matches_transformers(tmp_path: Path) -> None:
    for i, case in enumerate(REF["placement"]):
        settings = Qwen3MoeSettings.from_config(ModelConfig.from_pretrained(write_config(tmp_path / str(i),
                                                                                         **case["config"])))
        layers = case["config"]["num_hidden_layers"]
        assert [i for i in range(layers) if settings.is_moe_layer(i)] == case["moe_layers"], case["config"]
    model = load(MODEL)
    mlps = [layer.mlp for layer in model.model.layers]
    # decoder_sparse_step 2 leaves 0, 2 and 4 dense, mlp_only_layers [3] takes layer 3 from the experts
    assert [i for i, mlp in enumerate(mlps) if isinstance(mlp, SparseMoE)] == [1, 5]
    assert all(isinstance(mlps[i], GatedMLP) and mlps[i].down_proj.in_features == 96 for i in (0, 2, 3, 4))
    moe = mlps[1]
    assert (moe.num_experts, moe.top_k, moe.experts.down.k) == (8, 2, 32)
    assert moe.moe_statics is None and moe.shared_experts is None and moe.norm_min == 0.0
    assert not model.lm_head.tied


def test_norm_topk_prob_false_variant(tmp_path: Path) -> None:
    variant = REF["norm_topk_prob_variant"]
    model = load(write_variant(tmp_path, MODEL, variant["config"]))
    assert model.model.layers[1].mlp.norm_min is None  # the chosen weights are left as they are
    for case in variant["cases"]:
        check_teacher_forced(model, case, "qwen3_moe with norm_topk_prob false")


def test_transformers5_config_spelling(tmp_path: Path) -> None:
    """transformers 5's save_pretrained writes num_local_experts, dtype and rope_parameters (and the hub's
    per-expert tensor names, which the fixture has): the same model."""
    d = write_variant(tmp_path, MODEL, {})
    config = {k: v for k, v in CONFIG.items() if k not in ("num_experts", "torch_dtype", "rope_theta")}
    (d / "config.json").write_text(json.dumps(config | {
        "num_local_experts": 8, "dtype": "bfloat16",
        "rope_parameters": {"rope_theta": CONFIG["rope_theta"], "rope_type": "default"}}))
    model, expected = load(d), named_weights(load(MODEL))
    assert model.model.layers[5].mlp.num_experts == 8
    got = named_weights(model)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    check_teacher_forced(model, REF["cases"][2], "qwen3_moe, transformers 5 config")


@pytest.mark.parametrize("fn", [ops.fused_moe, ops.fused_moe_reference], ids=["compiled", "reference"])
def test_norm_min_zero_renormalises_exactly(fn) -> None:
    """The fused MoE op as Qwen3-MoE calls it: without a correction bias, norm_min 0 divides the chosen
    probabilities by their sum (transformers' norm_topk_prob) and None leaves them as they are."""
    rng = np.random.default_rng(3)
    layer = make_layer(rng, hidden=16, inter=8, experts=8, fmt="fp32", bias=False)
    x = rng.standard_normal((9, 16), dtype=np.float32)
    logits = x.astype(np.float64) @ ops.unpack_weight(layer["router"]).numpy().astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    for norm_min in (0.0, None):
        _, ids, weights = fn(paddle.to_tensor(x), layer["router"], None, layer["up_gate"], layer["down"], 3,
                             norm_min, 0, 8, return_routing=True)
        ids = ids.numpy()
        assert (np.sort(ids, -1) == np.sort(np.argsort(-probs, -1)[:, :3], -1)).all()
        chosen = np.take_along_axis(probs, ids, -1)
        want = chosen / chosen.sum(-1, keepdims=True) if norm_min is not None else chosen
        np.testing.assert_allclose(weights.numpy(), want, rtol=2e-6)


@pytest.mark.parametrize("changes, message", [
    ({"use_sliding_window": True, "sliding_window": 16}, "sliding-window attention"),
    ({"shared_expert_intermediate_size": 64}, "'shared_expert_intermediate_size'.*shared experts"),
    ({"num_experts_per_tok": 9}, r"'num_experts_per_tok' \(9\) must not exceed 'num_experts' \(8\)"),
    ({"num_experts_per_tok": None}, "required field 'num_experts_per_tok'"),
    ({"num_experts": None}, r"required field 'num_experts' \(or 'num_local_experts'\)"),
    ({"num_local_experts": 6}, r"'num_experts' \(8\) and 'num_local_experts' \(6\) disagree"),
    ({"moe_intermediate_size": None}, "required field 'moe_intermediate_size'"),
    ({"mlp_only_layers": [6]}, r"'mlp_only_layers' must be a list of layer indices in \[0, 6\)"),
    ({"mlp_only_layers": 3}, "'mlp_only_layers' must be a list"),
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be a positive integer"),
    ({"norm_topk_prob": "yes"}, "'norm_topk_prob' must be true or false"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_config_rejections(tmp_path: Path, changes: dict, message: str) -> None:
    config = ModelConfig.from_pretrained(write_config(tmp_path, **changes))
    with pytest.raises(ValueError, match=message):
        get_model_class(config.architectures)(config)


def test_config_defaults_and_registry(tmp_path: Path) -> None:
    # transformers' Qwen3MoeConfig: untied head, norm_topk_prob false, every layer sparse, unless told otherwise
    config = ModelConfig.from_pretrained(write_config(tmp_path, tie_word_embeddings=None, norm_topk_prob=None,
                                                      decoder_sparse_step=None, mlp_only_layers=None))
    assert config.tie_word_embeddings is False
    settings = Qwen3MoeSettings.from_config(config)
    assert not settings.norm_topk_prob and all(settings.is_moe_layer(i) for i in range(6))
    assert "Qwen3MoeForCausalLM" in supported_architectures()
    assert get_model_class(["Qwen3MoeForCausalLM"]).__name__ == "Qwen3MoeForCausalLM"
    # experts are divided whole among tensor-parallel ranks
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide num_experts \(7\)"):
        check_tp_size(2, ModelConfig.from_pretrained(write_config(tmp_path, num_experts=7)))


def test_benchmark_shape_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    """tools/random_checkpoint.py's qwen3_moe family (the qwen3-30b-a3b benchmark shape), shrunk: every layer
    MoE, q/k norms, untied head; the loader takes all of its tensors."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from random_checkpoint import SHAPES, ModelShape, write_checkpoint
    real = SHAPES["qwen3-30b-a3b"]
    assert (real.hidden, real.layers, real.heads, real.kv_heads, real.head_dim, real.vocab, real.experts,
            real.top_k, real.expert_ffn) == (2048, 48, 32, 4, 128, 151936, 128, 8, 768)
    shape = ModelShape("qwen3_moe", vocab=1024, hidden=64, layers=2, heads=6, kv_heads=2, head_dim=20, ffn=96,
                       experts=4, top_k=2, expert_ffn=32)
    write_checkpoint(tmp_path / "ckpt", shape, 2, progress=False)
    model = load(tmp_path / "ckpt")
    assert all(isinstance(layer.mlp, SparseMoE) and layer.mlp.norm_min == 0.0 for layer in model.model.layers)
    assert not model.lm_head.tied and model.model.layers[0].self_attn.q_norm is not None
