"""ERNIE-4.5 MoE (HF and Paddle layouts), Qwen2, Qwen3, Qwen3-MoE, Llama 3 and Mistral forwards vs
transformers' greedy outputs (tests/fixtures/reference/<fixture>_greedy.json, written by
tools/make_model_reference.py from the HF-layout fixtures). Greedy tokens must match exactly and logprobs within 1e-3, whether a sequence
runs in one forward, is prefilled then decoded through the paged KV cache, or is batched with the
others in chunks; config variants (MoE weight-sum floor, Qwen3 attention biases) and the MoE layer
placement rule are checked against transformers as well."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import paddle
import pytest
from safetensors.numpy import save_file

from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.layers.moe import SparseMoE
from fastdeploy.model_executor.load import Checkpoint, load_model
from fastdeploy.model_executor.models.ernie4_5_moe import ErnieMoeSettings
from fastdeploy.model_executor.weight_format import named_weights
from fastdeploy.ops.moe import grouped_expert_forward, select_experts
from fastdeploy.model_executor.models.registry import get_model_class
from test_ernie45_parity import Runner, check_batched_chunked, check_prefill_then_decode

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = FIXTURES / "models"
# fixture directory -> its reference file
FAMILIES = {
    "ernie45_moe_tiny_hf": "ernie45_moe_tiny_greedy.json",
    "ernie45_moe_tiny_paddle": "ernie45_moe_tiny_greedy.json",
    "qwen2_tiny": "qwen2_tiny_greedy.json",
    "qwen3_tiny": "qwen3_tiny_greedy.json",
    "qwen3_moe_tiny": "qwen3_moe_tiny_greedy.json",  # its specifics: test_qwen3_moe.py
    "llama3_tiny": "llama3_tiny_greedy.json",  # Llama / Mistral specifics: test_llama.py
    "mistral_tiny": "mistral_tiny_greedy.json",
}
REFS = {name: json.loads((FIXTURES / "reference" / name).read_text()) for name in set(FAMILIES.values())}
MOE_REF = REFS["ernie45_moe_tiny_greedy.json"]
TOL = 1e-3


def assert_matches(logprobs: np.ndarray, expected: dict, where: str) -> None:
    """logprobs [vocab] of one position vs one reference entry {token, logprob, top5}: same argmax (the
    reference's top-2 gaps of generated tokens exceed 1e-3), the reference's top-5 logprobs within TOL,
    and our own 5 best values equal to the reference's rank by rank within TOL, so no other token
    outranks them (entries closer than float32 rounding may swap places)."""
    if expected["top5"][0][1] - expected["top5"][1][1] > TOL:  # always so for generated tokens
        assert int(logprobs.argmax()) == expected["top5"][0][0], f"{where}: argmax"
    assert abs(logprobs[expected["token"]] - expected["logprob"]) < TOL, f"{where}: chosen logprob"
    for token, lp in expected["top5"]:
        assert abs(logprobs[token] - lp) < TOL, f"{where}: logprob of top-5 token {token}"
    ours = np.sort(logprobs)[::-1][:5]
    np.testing.assert_allclose(ours, [lp for _, lp in expected["top5"]], rtol=0, atol=TOL, err_msg=where)


def load(path: Path) -> paddle.nn.Layer:
    return load_model(ModelConfig.from_pretrained(path), dtype="float32")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[paddle.nn.Layer, dict]:
    return load(MODELS / request.param), REFS[FAMILIES[request.param]]


def check_teacher_forced(model: paddle.nn.Layer, case: dict, where: str) -> None:
    prompt, outputs = case["prompt_token_ids"], case["output_token_ids"]
    logprobs = Runner(model).step({0: prompt + outputs[:-1]})[0]
    n = len(prompt)
    assert logprobs[n - 1:].argmax(-1).tolist() == outputs, where
    for j, step in enumerate(case["steps"]):
        assert_matches(logprobs[n - 1 + j], step, f"{where}, prompt len {n}, step {j}")
    for p, entry in enumerate((case.get("prompt_logprobs") or [None])[1:], start=1):
        assert entry["token"] == prompt[p]
        assert_matches(logprobs[p - 1], entry, f"{where}, prompt len {n}, prompt position {p}")


def test_references_are_not_degenerate() -> None:
    # Greedy continuations that loop on one token would let a broken model pass.
    for ref in REFS.values():
        assert ref["max_new_tokens"] == 24 and ref["min_top2_gap"] > 1e-3
        for case in ref["cases"]:
            assert len(case["output_token_ids"]) == 24 and len(set(case["output_token_ids"])) >= 12
        assert sum(c["prompt_logprobs"] is not None for c in ref["cases"]) == 2
    # The MoE fixture exercises what it is meant to: the correction bias changes some expert choices,
    # no choice is a near tie, and the norm_min variant clamps some weight sums.
    routing = MOE_REF["routing"]
    assert routing["bias_changed_choices"] > 0.05 * routing["choices"] and routing["min_topk_margin"] > 1e-5
    assert MOE_REF["norm_min_variant"]["routing"]["clamped_weight_sums"] > 0


def test_teacher_forced_single_forward(family: tuple[paddle.nn.Layer, dict]) -> None:
    model, ref = family
    for case in ref["cases"]:
        check_teacher_forced(model, case, type(model).__name__)


def test_prefill_then_decode_with_kv_cache(family: tuple[paddle.nn.Layer, dict]) -> None:
    model, ref = family
    for case in ref["cases"]:
        check_prefill_then_decode(model, case, assert_matches)


def test_batched_chunked_prefill_and_decode(family: tuple[paddle.nn.Layer, dict]) -> None:
    """As for ERNIE dense; for MoE, routing groups the tokens of different requests."""
    model, ref = family
    check_batched_chunked(model, ref["cases"], assert_matches)


# ---- ERNIE-4.5 MoE specifics ----

def write_variant(tmp_path: Path, source: Path, config_changes: dict, extra: dict | None = None,
                  drop: str | None = None) -> Path:
    out = tmp_path / source.name
    out.mkdir()
    config = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **config_changes}))
    with Checkpoint(str(source)) as ckpt:
        tensors = {n: ckpt.read(n) for n in ckpt.tensors if n != drop}
    save_file({**tensors, **(extra or {})}, str(out / "model.safetensors"))
    return out


def test_moe_layer_placement_matches_transformers(tmp_path: Path) -> None:
    base = json.loads((MODELS / "ernie45_moe_tiny_hf" / "config.json").read_text())
    for case in MOE_REF["placement"]:
        config = {k: v for k, v in base.items() if k != "moe_layer_end_index"} | case["config"]
        (tmp_path / "config.json").write_text(json.dumps(config))
        settings = ErnieMoeSettings.from_config(ModelConfig.from_pretrained(tmp_path))
        layers = config["num_hidden_layers"]
        assert [i for i in range(layers) if settings.is_moe_layer(i)] == case["moe_layers"], case["config"]
    model = load(MODELS / "ernie45_moe_tiny_paddle")
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoE)]
    assert sparse == MOE_REF["placement"][0]["moe_layers"] == [1, 2]
    assert model.model.layers[1].mlp.shared_experts.down_proj.in_features == 2 * 32


@pytest.mark.parametrize("layout", ["hf", "paddle"])
def test_moe_norm_min_variant(tmp_path: Path, layout: str) -> None:
    variant = MOE_REF["norm_min_variant"]
    model = load(write_variant(tmp_path, MODELS / f"ernie45_moe_tiny_{layout}", variant["config"]))
    for case in variant["cases"]:
        check_teacher_forced(model, case, f"{layout}, moe_norm_min {variant['config']}")


def test_moe_layouts_load_identical_parameters() -> None:
    hf, pd = load(MODELS / "ernie45_moe_tiny_hf"), load(MODELS / "ernie45_moe_tiny_paddle")
    hf_params, pd_params = named_weights(hf), named_weights(pd)
    assert hf_params.keys() == pd_params.keys()
    for name, param in hf_params.items():
        np.testing.assert_array_equal(param, pd_params[name], err_msg=name)
    with Checkpoint(str(MODELS / "ernie45_moe_tiny_paddle")) as ckpt:
        # The Paddle copy carries multi-token-prediction tensors the loader must skip, and keeps the router
        # [hidden, experts] in float32.
        assert any(n.startswith("ernie.mtp_") for n in ckpt.tensors)
        gate = ckpt.tensors["ernie.layers.1.mlp.gate.weight"]
        assert gate.shape == (64, 6) and gate.dtype == "F32"


def test_moe_missing_correction_bias_means_plain_top_k(tmp_path: Path) -> None:
    """transformers keeps zeros for an absent e_score_correction_bias; so does the loader (optional)."""
    source = MODELS / "ernie45_moe_tiny_hf"
    d = write_variant(tmp_path, source, {}, drop="model.layers.1.mlp.moe_statics.e_score_correction_bias")
    model = load(d)
    np.testing.assert_array_equal(model.model.layers[1].mlp.moe_statics.e_score_correction_bias.numpy(),
                                  np.zeros((1, 6), np.float32))
    assert np.abs(model.model.layers[2].mlp.moe_statics.e_score_correction_bias.numpy()).max() > 0


def test_grouped_experts_equal_a_per_token_numpy_loop() -> None:
    """The grouped dispatch (sort by expert, one GEMM chain per expert, scatter-add) against a direct
    numpy evaluation of sum_j w[t, j] * expert_{id[t, j]}(x[t]) token by token."""
    rng = np.random.default_rng(0)
    weights = [(rng.standard_normal((8, 10)).astype(np.float32), rng.standard_normal((5, 8)).astype(np.float32))
               for _ in range(4)]

    def expert(up_gate: np.ndarray, down: np.ndarray):
        def run(x: paddle.Tensor) -> paddle.Tensor:
            h = paddle.matmul(x, paddle.to_tensor(up_gate))
            return paddle.matmul(paddle.nn.functional.silu(h[:, :5]) * h[:, 5:], paddle.to_tensor(down))
        return run
    experts = [expert(*w) for w in weights]
    x = rng.standard_normal((7, 8)).astype(np.float32)
    probs = rng.dirichlet(np.ones(4), size=7).astype(np.float32)
    bias = np.array([0.0, 0.3, 0.0, -0.3], np.float32)
    w, ids = select_experts(paddle.to_tensor(probs), 2, paddle.to_tensor(bias), norm_min=1e-12)
    got = grouped_expert_forward(paddle.to_tensor(x), w, ids, experts).numpy()

    def silu(v: np.ndarray) -> np.ndarray:
        return v / (1 + np.exp(-v))
    for t in range(7):
        chosen = np.argsort(-(probs[t] + bias), kind="stable")[:2]
        assert sorted(ids.numpy()[t].tolist()) == sorted(chosen.tolist())
        expected = np.zeros(8, np.float32)
        for e in chosen:
            up_gate, down = weights[e]
            h = x[t] @ up_gate
            expected += probs[t, e] / probs[t, chosen].sum() * ((silu(h[:5]) * h[5:]) @ down)
        np.testing.assert_allclose(got[t], expected, rtol=1e-4, atol=1e-5)


# ---- Qwen specifics ----

def test_qwen3_attention_bias_variant(tmp_path: Path) -> None:
    variant = REFS["qwen3_tiny_greedy.json"]["bias_variant"]
    biases = {n: np.asarray(v, np.float32) for n, v in variant["biases"].items()}
    assert len(biases) == 3 * 4  # q, k, v and o of each layer
    model = load(write_variant(tmp_path, MODELS / "qwen3_tiny", variant["config"], extra=biases))
    for case in variant["cases"]:
        check_teacher_forced(model, case, "qwen3 with attention_bias")


def test_qwen_layout_details() -> None:
    qwen2, qwen3 = load(MODELS / "qwen2_tiny"), load(MODELS / "qwen3_tiny")
    assert not qwen2.lm_head.tied and qwen3.lm_head.tied
    assert qwen2.model.layers[0].self_attn.qkv_proj.bias is not None
    assert qwen2.model.layers[0].self_attn.o_proj.bias is None and qwen2.model.layers[0].self_attn.q_norm is None
    attn = qwen3.model.layers[0].self_attn
    assert attn.qkv_proj.bias is None and attn.q_norm.weight.shape == [32]
    assert (qwen3.config.head_dim, qwen3.config.hidden_size, qwen3.config.num_attention_heads) == (32, 64, 4)


def test_qwen_config_defaults_and_rejections(tmp_path: Path) -> None:
    source = MODELS / "qwen2_tiny"
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(source / name, tmp_path / name)
    config = json.loads((source / "config.json").read_text())

    def with_config(**changes: object) -> ModelConfig:
        (tmp_path / "config.json").write_text(json.dumps(
            {k: v for k, v in {**config, **changes}.items() if v is not None}))
        return ModelConfig.from_pretrained(tmp_path)

    # transformers' Qwen2Config/Qwen3Config default tie_word_embeddings to False; ERNIE's to True.
    assert with_config(tie_word_embeddings=None).tie_word_embeddings is False
    assert with_config(tie_word_embeddings=None, model_type="ernie4_5").tie_word_embeddings is True
    with pytest.raises(ValueError, match="sliding-window attention layers are not supported"):
        get_model_class(["Qwen2ForCausalLM"])(with_config(use_sliding_window=True, sliding_window=16,
                                                          max_window_layers=1))
    with pytest.raises(ValueError, match="sliding-window"):
        get_model_class(["Qwen3ForCausalLM"])(with_config(layer_types=["full_attention", "sliding_attention"]))


def test_moe_config_rejections(tmp_path: Path) -> None:
    config = json.loads((MODELS / "ernie45_moe_tiny_hf" / "config.json").read_text())
    for changes, message in [
        ({"moe_num_experts": [6, 6]}, "'moe_num_experts' is a list"),
        ({"moe_k": 7}, r"'moe_k' \(7\) must not exceed 'moe_num_experts' \(6\)"),
        ({"moe_k": None}, "required field 'moe_k'"),
        ({"moe_num_shared_experts": -1}, "'moe_num_shared_experts' must be an integer >= 0"),
        ({"moe_gate_act": "sigmoid"}, "'moe_gate_act' must be 'softmax'"),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(
            {k: v for k, v in {**config, **changes}.items() if v is not None}))
        with pytest.raises(ValueError, match=message):
            get_model_class(config["architectures"])(ModelConfig.from_pretrained(tmp_path))


def test_registry_lists_every_family_for_unknown_architectures() -> None:
    for arch in ("Ernie4_5_MoeForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM",
                 "MistralForCausalLM"):
        assert get_model_class([arch]).__name__ == arch
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPTNeoXForCausalLM.*supported: ") as error:
        get_model_class(["GPTNeoXForCausalLM"])
    listed = str(error.value).split("supported: ")[1].split(", ")
    assert {"Ernie4_5ForCausalLM", "Ernie4_5_ForCausalLM", "Ernie4_5_MoeForCausalLM", "Qwen2ForCausalLM",
            "Qwen3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"} <= set(listed)
