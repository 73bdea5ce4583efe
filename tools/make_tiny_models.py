"""Write the tiny random ERNIE-4.5 dense test checkpoints, in both checkpoint layouts (numpy only).

    .venv/bin/python tools/make_tiny_models.py            # writes into tests/fixtures/models/

Outputs (deterministic: fixed seed, bf16-representable weights):
  tests/fixtures/models/ernie45_tiny_hf/       HF layout, as transformers' save_pretrained writes an
      `-PT` repo: config.json (`torch_dtype`, rope in `rope_parameters`), generation_config.json, one
      model.safetensors in BF16, keys `model.*`, linear weights [out, in], separate q/k/v and gate/up,
      no lm_head (tied).
  tests/fixtures/models/ernie45_tiny_paddle/   the same weights in the Paddle layout of `-Paddle` repos:
      keys `ernie.*`, linear weights [in, out], fused `qkv_proj` ([Q | K | V] on the output axis) and
      `up_gate_proj` ([gate | up]), raw bf16 bits stored as U16, two shards + model.safetensors.index.json,
      config.json with `dtype`, top-level `rope_theta`, architecture `Ernie4_5_ForCausalLM`.
Both get every file of tests/fixtures/tokenizers/ernie_sp/ (the 1024-piece SentencePiece tokenizer).
The config mirrors baidu/ERNIE-4.5-0.3B's field names and values, shrunk. After regenerating, rerun
tools/make_model_reference.py (transformers' outputs for the HF copy).
"""
from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "models"
TOKENIZER_DIR = ROOT / "tests" / "fixtures" / "tokenizers" / "ernie_sp"
SEED = 20251121
# Chosen by trying a few: with these, greedy continuations vary (no loop on one token) and the top-2
# logprob gaps stay > 1e-2, so argmax comparisons are not decided by rounding.
EMBED_STD, PROJ_STD = 0.4, 0.4

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 1024, 64, 2, 4, 2, 16, 128

BASE_CONFIG = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "max_position_embeddings": 131072,
    "model_type": "ernie4_5",
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "num_hidden_layers": LAYERS,
    "rms_norm_eps": 1e-05,
    "use_cache": False,
    "vocab_size": VOCAB,
    "use_bias": False,
    "tie_word_embeddings": True,
}
# Shaped like the 0.3B's generation_config.json.
GENERATION_CONFIG = {
    "do_sample": True,
    "top_p": 0.8,
    "temperature": 0.8,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def make_hf_weights(rng: np.random.Generator, embed_std: float = EMBED_STD,
                    proj_std: float = PROJ_STD) -> dict[str, np.ndarray]:
    """HF-layout float32 tensors whose values are exactly representable in bf16."""
    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
        x = (rng.standard_normal(shape) * std + mean).astype(np.float32)
        return bf16_bits_to_f32(to_bf16_bits(x))

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    w = {"model.embed_tokens.weight": normal((VOCAB, HIDDEN), embed_std)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = normal((HIDDEN,), 0.1, 1.0)
        w[p + "self_attn.q_proj.weight"] = normal((q, HIDDEN), proj_std)
        w[p + "self_attn.k_proj.weight"] = normal((kv, HIDDEN), proj_std)
        w[p + "self_attn.v_proj.weight"] = normal((kv, HIDDEN), proj_std)
        w[p + "self_attn.o_proj.weight"] = normal((HIDDEN, q), proj_std)
        w[p + "post_attention_layernorm.weight"] = normal((HIDDEN,), 0.1, 1.0)
        w[p + "mlp.gate_proj.weight"] = normal((FFN, HIDDEN), proj_std)
        w[p + "mlp.up_proj.weight"] = normal((FFN, HIDDEN), proj_std)
        w[p + "mlp.down_proj.weight"] = normal((HIDDEN, FFN), proj_std)
    w["model.norm.weight"] = normal((HIDDEN,), 0.1, 1.0)
    return w


def to_paddle_layout(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {"ernie.embed_tokens.weight": hf["model.embed_tokens.weight"]}
    for i in range(LAYERS):
        h, p = f"model.layers.{i}.", f"ernie.layers.{i}."
        out[p + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        # [out, in] -> [in, out]; fused parts are concatenated along the output axis.
        out[p + "self_attn.qkv_proj.weight"] = np.concatenate(
            [hf[h + f"self_attn.{n}_proj.weight"].T for n in "qkv"], axis=1)
        out[p + "self_attn.o_proj.weight"] = hf[h + "self_attn.o_proj.weight"].T
        out[p + "post_attention_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[p + "mlp.up_gate_proj.weight"] = np.concatenate(
            [hf[h + "mlp.gate_proj.weight"].T, hf[h + "mlp.up_proj.weight"].T], axis=1)
        out[p + "mlp.down_proj.weight"] = hf[h + "mlp.down_proj.weight"].T
    out["ernie.norm.weight"] = hf["model.norm.weight"]
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str,
                      metadata: dict[str, str] | None = None) -> int:
    """Write float32 tensors stored as `dtype` (BF16 / U16 = bf16 bits, F16, F32); returns data bytes."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    blobs, offset = [], 0
    for name, x in tensors.items():
        if dtype in ("BF16", "U16"):
            data = to_bf16_bits(x).tobytes()
        elif dtype == "F16":
            data = np.ascontiguousarray(x, dtype="<f2").tobytes()
        elif dtype == "F32":
            data = np.ascontiguousarray(x, dtype="<f4").tobytes()
        else:
            raise ValueError(f"unsupported dtype {dtype}")
        header[name] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in blobs:
            f.write(data)
    return offset


def write_json(path: Path, obj: dict[str, object]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def copy_tokenizer(dst: Path) -> None:
    if not TOKENIZER_DIR.is_dir():
        print(f"warning: {TOKENIZER_DIR} does not exist; {dst.name} has no tokenizer files", file=sys.stderr)
        return
    for f in sorted(TOKENIZER_DIR.iterdir()):
        if f.is_file():
            shutil.copy2(f, dst / f.name)


def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def main() -> None:
    hf = make_hf_weights(np.random.default_rng(SEED))

    hf_dir = fresh_dir(OUT / "ernie45_tiny_hf")
    write_json(hf_dir / "config.json", {
        "architectures": ["Ernie4_5ForCausalLM"], **BASE_CONFIG,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "torch_dtype": "bfloat16",
    })
    write_json(hf_dir / "generation_config.json", GENERATION_CONFIG)
    write_safetensors(hf_dir / "model.safetensors", hf, "BF16")
    copy_tokenizer(hf_dir)

    pd_dir = fresh_dir(OUT / "ernie45_tiny_paddle")
    write_json(pd_dir / "config.json", {
        "architectures": ["Ernie4_5_ForCausalLM"], **BASE_CONFIG, "rope_theta": 500000, "dtype": "bfloat16",
    })
    write_json(pd_dir / "generation_config.json", GENERATION_CONFIG)
    paddle_w = to_paddle_layout(hf)
    names = list(paddle_w)
    split = names.index("ernie.layers.1.input_layernorm.weight")
    weight_map, total = {}, 0
    for k, chunk in enumerate((names[:split], names[split:])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        total += write_safetensors(pd_dir / file, {n: paddle_w[n] for n in chunk}, "U16")
        weight_map.update({n: file for n in chunk})
    write_json(pd_dir / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    copy_tokenizer(pd_dir)
    print(f"wrote {hf_dir} and {pd_dir}")


if __name__ == "__main__":
    main()
