"""Config parsing, safetensors reading and checkpoint-layout handling.

Test files are written with the `safetensors` package (an independent writer) where numpy can express
the dtype; bfloat16 cases use known bit patterns whose float values are exact."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from fastdeploy.model_executor.model_config import ModelConfig
from fastdeploy.model_executor.load import Checkpoint, load_model, read_safetensors_header
from fastdeploy.model_executor.models.registry import get_model_class, supported_architectures
from fastdeploy.model_executor.weight_format import named_weights

MODELS = Path(__file__).parent / "fixtures" / "models"
HF_DIR, PADDLE_DIR = MODELS / "ernie45_tiny_hf", MODELS / "ernie45_tiny_paddle"


def params(model) -> dict[str, np.ndarray]:
    return named_weights(model)


def hf_tensors() -> dict[str, np.ndarray]:
    with Checkpoint(str(HF_DIR)) as ckpt:
        return {name: ckpt.read(name) for name in ckpt.tensors}


def model_dir(tmp_path: Path, source: Path = HF_DIR, **config_changes: object) -> Path:
    """A copy of `source`'s config files (no weights) with config.json fields changed (None deletes)."""
    out = tmp_path / "model"
    out.mkdir(parents=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    config = json.loads((out / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


def retype_header(path: Path, dtype: str) -> None:
    """Rewrite a safetensors file's dtype field (same element size), e.g. U16 -> BF16."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    for name, entry in header.items():
        if name != "__metadata__":
            entry["dtype"] = dtype
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


# ---- config.json / generation_config.json ----

def test_config_from_both_fixture_layouts() -> None:
    hf, pd = ModelConfig.from_pretrained(HF_DIR), ModelConfig.from_pretrained(PADDLE_DIR)
    assert hf.architectures == ["Ernie4_5ForCausalLM"] and pd.architectures == ["Ernie4_5_ForCausalLM"]
    generation = json.loads((HF_DIR / "generation_config.json").read_text())
    for cfg in (hf, pd):
        # HF copy: rope_parameters.rope_theta + torch_dtype; Paddle copy: top-level rope_theta + dtype.
        assert cfg.rope_theta == 500000.0 and cfg.dtype == "bfloat16"
        assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 1024)
        assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 131072
        assert cfg.tie_word_embeddings is True and cfg.use_bias is False
        assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (1, [2], 0)
        assert cfg.generation_defaults == {k: generation[k] for k in (
            "temperature", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty")}


def test_generation_config_eos_list_and_field_mapping(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    (d / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 7], "top_k": 20, "min_p": 0.05, "max_new_tokens": 99, "do_sample": True,
         "bos_token_id": 1}))
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.eos_token_ids == [2, 7]
    assert cfg.generation_defaults == {"top_k": 20, "min_p": 0.05, "max_tokens": 99}
    (d / "generation_config.json").unlink()  # without it: config.json's eos, no defaults
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.eos_token_ids == [2] and cfg.generation_defaults == {}


def test_config_defaults_for_optional_fields(tmp_path: Path) -> None:
    d = model_dir(tmp_path, head_dim=None, num_key_value_heads=None, rope_parameters=None, torch_dtype=None)
    cfg = ModelConfig.from_pretrained(d)
    assert cfg.head_dim == 64 // 4 and cfg.num_key_value_heads == 4
    assert cfg.rope_theta == 10000.0 and cfg.dtype == "float32"


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": None}, "config.json: required field 'hidden_size'"),
    ({"vocab_size": "1024"}, "'vocab_size' must be a positive integer"),
    ({"num_key_value_heads": 3}, "'num_attention_heads' .4. must be a multiple of 'num_key_value_heads' .3."),
    ({"head_dim": 15}, "'head_dim' must be even and at least 2, got 15"),
    ({"architectures": []}, "'architectures'"),
    ({"torch_dtype": "int3"}, "'torch_dtype' must be one of"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "'rope_parameters.rope_type' is 'yarn'"),
    ({"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
])
def test_bad_config_names_the_field(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(model_dir(tmp_path, **changes))


def test_bad_config_files(tmp_path: Path) -> None:
    d = model_dir(tmp_path)
    (d / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ValueError, match="generation_config.json: field 'temperature'"):
        ModelConfig.from_pretrained(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        ModelConfig.from_pretrained(d)
    (d / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json not found"):
        ModelConfig.from_pretrained(d)
    with pytest.raises(ValueError, match="not a directory"):
        ModelConfig.from_pretrained(tmp_path / "nowhere")


# ---- safetensors reading ----

BF16_BITS = np.array([0x3F80, 0xC000, 0x3E20, 0x4049, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001], dtype=np.uint16)
BF16_VALUES = np.array([1.0, -2.0, 0.15625, 3.140625, 0.0, -0.0, np.inf, -np.inf, 2.0 ** -133], dtype=np.float32)


@pytest.mark.parametrize("stored", ["BF16", "U16"])
def test_bf16_and_raw_u16_decode(tmp_path: Path, stored: str) -> None:
    f = tmp_path / "t.safetensors"
    save_file({"x": BF16_BITS.reshape(3, 3)}, str(f))  # numpy uint16 -> dtype U16
    if stored == "BF16":
        retype_header(f, "BF16")
    assert read_safetensors_header(str(f))["x"].dtype == stored
    with Checkpoint(str(tmp_path)) as ckpt:
        x = ckpt.read("x")
    assert x.dtype == np.float32 and x.shape == (3, 3)
    np.testing.assert_array_equal(x.ravel(), BF16_VALUES)
    assert np.signbit(x.ravel()[5])  # -0.0 keeps its sign


def test_u16_as_float16_and_f16_f32_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((5, 7)).astype(np.float32)
    f16 = rng.standard_normal((4,)).astype(np.float16)
    save_file({"a": f32, "b": f16, "c": np.array([0x3C00, 0xC500], dtype=np.uint16)},
              str(tmp_path / "model.safetensors"))
    with Checkpoint(str(tmp_path), u16_dtype="float16") as ckpt:
        assert {n: i.dtype for n, i in ckpt.tensors.items()} == {"a": "F32", "b": "F16", "c": "U16"}
        np.testing.assert_array_equal(ckpt.read("a"), f32)
        np.testing.assert_array_equal(ckpt.read("b"), f16.astype(np.float32))
        np.testing.assert_array_equal(ckpt.read("c"), [1.0, -5.0])  # fp16 bits of 1.0 and -5.0


def test_corrupt_files_are_rejected(tmp_path: Path) -> None:
    f = tmp_path / "bad.safetensors"
    f.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(ValueError, match="bad.safetensors: not a safetensors file"):
        read_safetensors_header(str(f))
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(ValueError, match="tensor 'w'"):
        read_safetensors_header(str(f))
    header = json.dumps({"w": {"dtype": "I8", "shape": [1], "data_offsets": [0, 1]}}).encode()
    f.write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(ValueError, match="tensor 'w' has dtype I8"):
        read_safetensors_header(str(f))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no model.safetensors"):
        Checkpoint(str(empty))


# ---- layouts ----

def test_both_layouts_load_identical_parameters() -> None:
    hf = params(load_model(ModelConfig.from_pretrained(HF_DIR)))
    pd = params(load_model(ModelConfig.from_pretrained(PADDLE_DIR)))
    assert hf.keys() == pd.keys()
    for name in hf:
        np.testing.assert_array_equal(hf[name], pd[name], err_msg=name)
    # And they are the checkpoint's values: HF q/k/v and gate/up side by side, transposed to [in, out].
    raw = hf_tensors()
    p = "model.layers.1."
    expected_qkv = np.concatenate([raw[p + f"self_attn.{n}_proj.weight"].T for n in "qkv"], axis=1)
    np.testing.assert_array_equal(hf[p + "self_attn.qkv_proj.weight"], expected_qkv)
    expected_gate_up = np.concatenate([raw[p + "mlp.gate_proj.weight"].T, raw[p + "mlp.up_proj.weight"].T], axis=1)
    np.testing.assert_array_equal(hf[p + "mlp.up_gate_proj.weight"], expected_gate_up)
    np.testing.assert_array_equal(hf["model.embed_tokens.weight"], raw["model.embed_tokens.weight"])
    assert "lm_head.weight" not in hf  # tied to the embedding


def test_paddle_fixture_is_the_paddle_layout() -> None:
    index = json.loads((PADDLE_DIR / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    with Checkpoint(str(PADDLE_DIR)) as ckpt:
        assert {i.dtype for i in ckpt.tensors.values()} == {"U16"}
        assert all(n.startswith("ernie.") for n in ckpt.tensors)
        assert ckpt.tensors["ernie.layers.0.self_attn.qkv_proj.weight"].shape == (64, 64 + 32 + 32)
        assert ckpt.tensors["ernie.layers.0.mlp.up_gate_proj.weight"].shape == (64, 256)
        assert ckpt.tensors["ernie.layers.0.mlp.down_proj.weight"].shape == (128, 64)


def test_sharded_f32_checkpoint_and_bad_index(tmp_path: Path) -> None:
    raw = hf_tensors()
    d = model_dir(tmp_path)
    names = sorted(raw)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: raw[n] for n in part}, str(d / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = params(load_model(ModelConfig.from_pretrained(d)))
    reference = params(load_model(ModelConfig.from_pretrained(HF_DIR)))
    for name in reference:
        np.testing.assert_array_equal(loaded[name], reference[name], err_msg=name)

    weight_map[names[0]] = "c.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=f"{names[0]}.*'c.safetensors', which does not exist"):
        load_model(ModelConfig.from_pretrained(d))


def write_variant(tmp_path: Path, source: Path, drop: str | None = None, add: str | None = None,
                  reshape: str | None = None) -> Path:
    d = model_dir(tmp_path, source)
    with Checkpoint(str(source)) as ckpt:
        tensors = {n: ckpt.read(n) for n in ckpt.tensors if n != drop}
    if add:
        tensors[add] = np.zeros((4, 4), np.float32)
    if reshape:
        tensors[reshape] = tensors[reshape][:, :-1].copy()
    save_file(tensors, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("source, drop", [
    (HF_DIR, "model.layers.1.self_attn.k_proj.weight"),
    (HF_DIR, "model.norm.weight"),
    (PADDLE_DIR, "ernie.layers.0.mlp.up_gate_proj.weight"),
    (PADDLE_DIR, "ernie.embed_tokens.weight"),
])
def test_missing_tensor_is_named(tmp_path: Path, source: Path, drop: str) -> None:
    d = write_variant(tmp_path, source, drop=drop)
    with pytest.raises(ValueError, match=f"missing tensors .1.: {drop}$"):
        load_model(ModelConfig.from_pretrained(d))


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    d = write_variant(tmp_path, HF_DIR, add="model.layers.0.self_attn.rotary.weight")
    with pytest.raises(ValueError, match=r"unexpected tensors .* \(1\): model.layers.0.self_attn.rotary.weight"):
        load_model(ModelConfig.from_pretrained(d))


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    d = write_variant(tmp_path, HF_DIR, reshape="model.layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight \(stored shape \[64, 127\]"):
        load_model(ModelConfig.from_pretrained(d))


def test_untied_lm_head_in_both_orientations(tmp_path: Path) -> None:
    """With tie_word_embeddings false the checkpoint's own lm_head is used: [vocab, hidden] in HF files,
    [hidden, vocab] in Paddle files."""
    raw = hf_tensors()
    head = np.random.default_rng(1).standard_normal((1024, 64)).astype(np.float32)
    d = model_dir(tmp_path, tie_word_embeddings=False)
    save_file({**raw, "lm_head.weight": head}, str(d / "model.safetensors"))
    model = load_model(ModelConfig.from_pretrained(d))
    np.testing.assert_array_equal(params(model)["lm_head.weight"], head.T)

    pd_dir = model_dir(tmp_path / "pd", PADDLE_DIR, tie_word_embeddings=False)
    with Checkpoint(str(PADDLE_DIR)) as ckpt:
        tensors = {n: ckpt.read(n) for n in ckpt.tensors}
    save_file({**tensors, "lm_head.weight": np.ascontiguousarray(head.T)}, str(pd_dir / "model.safetensors"))
    model = load_model(ModelConfig.from_pretrained(pd_dir))
    np.testing.assert_array_equal(params(model)["lm_head.weight"], head.T)

    save_file(raw, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors .1.: lm_head.weight"):
        load_model(ModelConfig.from_pretrained(d))


# ---- architectures ----

def test_registry_knows_both_ernie_spellings() -> None:
    assert {"Ernie4_5ForCausalLM", "Ernie4_5_ForCausalLM"} <= set(supported_architectures())
    assert get_model_class(["Ernie4_5_ForCausalLM"]) is get_model_class(["Ernie4_5ForCausalLM"])
    assert get_model_class(["SomethingElse", "Ernie4_5ForCausalLM"]).__name__ == "Ernie4_5ForCausalLM"


def test_unknown_architecture(tmp_path: Path) -> None:
    d = model_dir(tmp_path, architectures=["FooForCausalLM"])
    with pytest.raises(ValueError, match=r"unsupported architecture.*FooForCausalLM.*supported: .*Ernie4_5ForCausalLM"):
        load_model(ModelConfig.from_pretrained(d))
