"""Write the tiny random test checkpoints (numpy only) into tests/fixtures/models/.

    .venv/bin/python tools/make_tiny_models.py [family ...]   # families: ernie45 ... mistral (FAMILIES)

Deterministic (fixed seeds; weights bf16-representable unless stored as F32). Each family's config
mirrors the real repos' field names and values, shrunk to vocab 1024 / hidden 64:
  ernie45_tiny_hf/, ernie45_tiny_paddle/      ERNIE-4.5 dense (as baidu/ERNIE-4.5-0.3B-PT / -Paddle).
  ernie45_moe_tiny_hf/, ernie45_moe_tiny_paddle/   ERNIE-4.5 MoE (as ERNIE-4.5-21B-A3B): 4 layers, layers
      1-2 MoE (6 experts, top-2, 2 shared experts, score-correction bias), 0 and 3 dense.
  qwen2_tiny/    Qwen2.5-shaped: q/k/v biases, untied lm_head, tokenizer bpe_json.
  qwen3_tiny/    Qwen3-shaped: q/k norms, head_dim 32 != hidden / heads, tied embeddings, bpe_json.
  qwen3_moe_tiny/  Qwen3-MoE (as Qwen3-30B-A3B): 6 layers, 6 q / 2 kv heads of head_dim 20, untied head;
      decoder_sparse_step 2 and mlp_only_layers [3] make layers 1 and 5 MoE (8 experts, top-2, expert FFN 32,
      norm_topk_prob, no shared experts or correction bias), the others dense; router stored BF16 as the hub's.
  llama3_tiny/   Llama-3.1-shaped: hidden 96, 6 q / 2 kv heads of head_dim 24, llama3 rope_scaling with
      original_max_position_embeddings 32 (all three frequency bands in use), untied head, bpe_json.
  mistral_tiny/  Mistral-7B-v0.3-shaped: 4 q / 1 kv heads, sliding_window null, untied head, bpe_json.
HF copies are laid out as transformers' save_pretrained / the hub's `-PT` repos write them: keys
`model.*`, linear weights [out, in], separate q/k/v and gate/up, per-expert `mlp.experts.K.*`, BF16
(the MoE router `mlp.gate.weight` and `mlp.moe_statics.e_score_correction_bias` in F32, as
transformers keeps them). Paddle copies (`-Paddle` repos) hold the same values: keys `ernie.*`,
linear weights [in, out], fused `qkv_proj` ([Q | K | V] on the output axis) and `up_gate_proj`
([gate | up]), raw bf16 bits stored as U16, two shards + model.safetensors.index.json, config with
`dtype` and top-level `rope_theta`; the MoE copy also carries multi-token-prediction tensors
(`ernie.mtp_*`), which inference skips. After regenerating, rerun tools/make_model_reference.py.
"""
from __future__ import annotations

import json
import shutil
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "models"
TOKENIZERS = ROOT / "tests" / "fixtures" / "tokenizers"
SEED = 20251121
# Chosen by trying a few: with these, greedy continuations vary (no loop on one token) and the top-2
# logprob gaps stay > 1e-2, so argmax comparisons are not decided by rounding.
EMBED_STD, PROJ_STD = 0.4, 0.4
ROUTER_STD, CORRECTION_BIAS_STD, QKV_BIAS_STD = 0.15, 0.05, 0.3


@dataclass(frozen=True)
class Shape:
    vocab: int = 1024
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128


# ERNIE-4.5 dense, kept as the module-level names older code uses.
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 1024, 64, 2, 4, 2, 16, 128
ERNIE = Shape()
MOE_SHAPE = Shape(layers=4)
MOE = {"experts": 6, "top_k": 2, "ffn": 32, "shared": 2, "start": 1, "end": 2, "interval": 1}
QWEN2 = Shape(layers=2)
QWEN3 = Shape(layers=3, head_dim=32)
# Llama-3.1-shaped: GQA groups of 3, head_dim 24 (not a power of two; given, as Llama 3.2's configs do, and
# not hidden / heads; transformers' LlamaConfig wants hidden to be a multiple of heads all the same).
LLAMA3 = Shape(hidden=96, layers=2, heads=6, kv_heads=2, head_dim=24, ffn=192)
MISTRAL = Shape(layers=2, heads=4, kv_heads=1, head_dim=16, ffn=224)  # Mistral-7B's groups of 4, FFN 3.5x
# Llama 3.1's rope_scaling with original_max_position_embeddings 32 (8192 in the real one), so that at the
# fixture's positions wavelengths fall in all three bands: kept, interpolated and divided by the factor.
LLAMA3_ROPE_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 32, "rope_type": "llama3"}
QWEN3_MOE = Shape(layers=6, heads=6, kv_heads=2, head_dim=20, ffn=96)
QWEN3_MOE_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                     "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": True}

BASE_CONFIG = {
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_act": "silu", "hidden_size": HIDDEN,
    "intermediate_size": FFN, "max_position_embeddings": 131072, "model_type": "ernie4_5",
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "num_hidden_layers": LAYERS, "rms_norm_eps": 1e-05, "use_cache": False, "vocab_size": VOCAB,
    "use_bias": False, "tie_word_embeddings": True,
}
# Shaped like the 0.3B's generation_config.json.
GENERATION_CONFIG = {
    "do_sample": True, "top_p": 0.8, "temperature": 0.8, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
# Field names and non-size values of ERNIE-4.5-21B-A3B's config.json.
MOE_CONFIG = {
    **BASE_CONFIG, "model_type": "ernie4_5_moe", "num_hidden_layers": MOE_SHAPE.layers,
    "moe_num_experts": MOE["experts"], "moe_k": MOE["top_k"], "moe_intermediate_size": MOE["ffn"],
    "moe_num_shared_experts": MOE["shared"], "moe_layer_start_index": MOE["start"],
    "moe_layer_end_index": MOE["end"], "moe_layer_interval": MOE["interval"], "moe_capacity": [6, 6, 6],
    "moe_gate": "topk", "moe_use_aux_free": True, "moe_norm_min": 1e-12,
}
# Qwen ids in the 1024-token BPE fixture: <|endoftext|> 1019, <|im_end|> 1021.
QWEN_GENERATION_CONFIG = {"bos_token_id": 1019, "do_sample": True, "eos_token_id": [1021, 1019],
                          "pad_token_id": 1019, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def qwen_config(arch: str, model_type: str, shape: Shape, tied: bool, **extra: object) -> dict[str, object]:
    return {
        "architectures": [arch], "attention_dropout": 0.0, "bos_token_id": 1019, "eos_token_id": 1021,
        "hidden_act": "silu", "hidden_size": shape.hidden, "initializer_range": 0.02,
        "intermediate_size": shape.ffn, "max_position_embeddings": 32768, "max_window_layers": shape.layers,
        "model_type": model_type, "num_attention_heads": shape.heads, "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": shape.vocab,
        **extra,
    }


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Weights:
    """Draws HF-layout tensors from one generator, bf16-exact unless `exact=False`."""

    def __init__(self, rng: np.random.Generator, proj_std: float = PROJ_STD) -> None:
        self.rng, self.proj_std, self.w = rng, proj_std, {}

    def normal(self, name: str, shape: tuple[int, ...], std: float | None = None, mean: float = 0.0,
               exact: bool = False) -> None:
        x = (self.rng.standard_normal(shape) * (self.proj_std if std is None else std) + mean).astype(np.float32)
        self.w[name] = x if exact else bf16_bits_to_f32(to_bf16_bits(x))

    def norm(self, name: str, size: int) -> None:
        self.normal(name, (size,), 0.1, 1.0)

    def mlp(self, p: str, hidden: int, ffn: int) -> None:
        self.normal(p + "gate_proj.weight", (ffn, hidden))
        self.normal(p + "up_proj.weight", (ffn, hidden))
        self.normal(p + "down_proj.weight", (hidden, ffn))

    def decoder(self, s: Shape, make_mlp: Callable[[str, int], None], qkv_bias: bool = False, qk_norm: bool = False,
                embed_std: float = EMBED_STD) -> dict[str, np.ndarray]:
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.normal("model.embed_tokens.weight", (s.vocab, s.hidden), embed_std)
        for i in range(s.layers):
            p = f"model.layers.{i}."
            self.norm(p + "input_layernorm.weight", s.hidden)
            for name, rows in (("q", q), ("k", kv), ("v", kv)):
                self.normal(p + f"self_attn.{name}_proj.weight", (rows, s.hidden))
            self.normal(p + "self_attn.o_proj.weight", (s.hidden, q))
            if qkv_bias:
                for name, rows in (("q", q), ("k", kv), ("v", kv)):
                    self.normal(p + f"self_attn.{name}_proj.bias", (rows,), QKV_BIAS_STD)
            if qk_norm:
                self.norm(p + "self_attn.q_norm.weight", s.head_dim)
                self.norm(p + "self_attn.k_norm.weight", s.head_dim)
            self.norm(p + "post_attention_layernorm.weight", s.hidden)
            make_mlp(p + "mlp.", i)
        self.norm("model.norm.weight", s.hidden)
        return self.w


def make_hf_weights(rng: np.random.Generator, embed_std: float = EMBED_STD,
                    proj_std: float = PROJ_STD) -> dict[str, np.ndarray]:
    """ERNIE-4.5 dense HF-layout float32 tensors."""
    w = Weights(rng, proj_std)
    return w.decoder(ERNIE, lambda p, i: w.mlp(p, HIDDEN, FFN), embed_std=embed_std)


def make_moe_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    w, s = Weights(rng), MOE_SHAPE

    def mlp(p: str, i: int) -> None:
        if not (MOE["start"] <= i <= MOE["end"] and (i + 1) % MOE["interval"] == 0):
            w.mlp(p, s.hidden, s.ffn)
            return
        w.normal(p + "gate.weight", (MOE["experts"], s.hidden), ROUTER_STD, exact=True)
        w.normal(p + "moe_statics.e_score_correction_bias", (1, MOE["experts"]), CORRECTION_BIAS_STD, exact=True)
        for e in range(MOE["experts"]):
            w.mlp(p + f"experts.{e}.", s.hidden, MOE["ffn"])
        w.mlp(p + "shared_experts.", s.hidden, MOE["ffn"] * MOE["shared"])
    return w.decoder(s, mlp)


def to_paddle_layout(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF names/orientation -> Paddle: `ernie.` prefix, [in, out], q/k/v and gate/up fused."""
    out = {}
    for name, x in hf.items():
        p = "ernie." + name[len("model."):] if name.startswith("model.") else name
        if any(name.endswith(f"{n}_proj.weight") for n in ("k", "v", "up")):
            continue  # written with their q / gate partner
        if name.endswith("q_proj.weight"):
            out[p.replace("q_proj", "qkv_proj")] = np.concatenate(
                [hf[name.replace("q_proj", f"{n}_proj")].T for n in "qkv"], axis=1)
        elif name.endswith("gate_proj.weight"):
            out[p.replace("gate_proj", "up_gate_proj")] = np.concatenate(
                [x.T, hf[name.replace("gate_proj", "up_proj")].T], axis=1)
        elif x.ndim == 2 and "embed_tokens" not in name and "moe_statics" not in name:
            out[p] = x.T
        else:
            out[p] = x
    return out


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str | Callable[[str], str],
                      metadata: dict[str, str] | None = None) -> int:
    """Write float32 tensors stored as `dtype` (BF16 / U16 = bf16 bits, F16, F32; or a function of the
    name giving one of these); returns the data bytes."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    blobs, offset = [], 0
    for name, x in tensors.items():
        kind = dtype(name) if callable(dtype) else dtype
        if kind in ("BF16", "U16"):
            data = to_bf16_bits(x).tobytes()
        elif kind == "F16":
            data = np.ascontiguousarray(x, dtype="<f2").tobytes()
        elif kind == "F32":
            data = np.ascontiguousarray(x, dtype="<f4").tobytes()
        else:
            raise ValueError(f"unsupported dtype {kind}")
        header[name] = {"dtype": kind, "shape": list(x.shape), "data_offsets": [offset, offset + len(data)]}
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


def write_sharded(out: Path, tensors: dict[str, np.ndarray], split_at: str, dtype: str | Callable[[str], str]) -> None:
    """Two shards (the second starting at tensor `split_at`) and model.safetensors.index.json."""
    names = list(tensors)
    split = names.index(split_at)
    weight_map, total = {}, 0
    for k, chunk in enumerate((names[:split], names[split:])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        total += write_safetensors(out / file, {n: tensors[n] for n in chunk}, dtype)
        weight_map.update({n: file for n in chunk})
    write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_json(path: Path, obj: dict[str, object]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def copy_tokenizer(dst: Path, tokenizer: str = "ernie_sp") -> None:
    src = TOKENIZERS / tokenizer
    if not src.is_dir():
        print(f"warning: {src} does not exist; {dst.name} has no tokenizer files", file=sys.stderr)
        return
    for f in sorted(src.iterdir()):
        if f.is_file():
            shutil.copy2(f, dst / f.name)


def fresh_dir(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def write_ernie_pair(name: str, hf: dict[str, np.ndarray], config: dict[str, object], arch: tuple[str, str],
                     split_at: str, hf_dtype: str | Callable[[str], str] = "BF16",
                     paddle_extra: dict[str, np.ndarray] | None = None) -> None:
    hf_dir = fresh_dir(OUT / f"{name}_hf")
    write_json(hf_dir / "config.json", {
        "architectures": [arch[0]], **config,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "torch_dtype": "bfloat16"})
    write_json(hf_dir / "generation_config.json", GENERATION_CONFIG)
    write_safetensors(hf_dir / "model.safetensors", hf, hf_dtype)
    copy_tokenizer(hf_dir)

    pd_dir = fresh_dir(OUT / f"{name}_paddle")
    write_json(pd_dir / "config.json",
               {"architectures": [arch[1]], **config, "rope_theta": 500000, "dtype": "bfloat16"})
    write_json(pd_dir / "generation_config.json", GENERATION_CONFIG)
    pd = {**to_paddle_layout(hf), **(paddle_extra or {})}
    # Paddle checkpoints keep the router in float32 too; everything else is raw bf16 bits (U16).
    write_sharded(pd_dir, pd, split_at, lambda n: "F32" if ".mlp.gate." in n or "moe_statics" in n else "U16")
    copy_tokenizer(pd_dir)
    print(f"wrote {hf_dir} and {pd_dir}")


def ernie45() -> None:
    hf = make_hf_weights(np.random.default_rng(SEED))
    write_ernie_pair("ernie45_tiny", hf, BASE_CONFIG, ("Ernie4_5ForCausalLM", "Ernie4_5_ForCausalLM"),
                     "ernie.layers.1.input_layernorm.weight")


def ernie45_moe() -> None:
    hf = make_moe_weights(np.random.default_rng(SEED + 1))
    rng = np.random.default_rng(SEED + 2)
    mtp = {  # a few multi-token-prediction tensors, named as in the -Paddle repos; inference skips them
        "ernie.mtp_emb_norm.0.weight": np.ones(HIDDEN, np.float32),
        "ernie.mtp_hidden_norm.0.weight": np.ones(HIDDEN, np.float32),
        "ernie.mtp_linear_proj.0.weight": rng.standard_normal((2 * HIDDEN, HIDDEN)).astype(np.float32),
        "ernie.mtp_block.0.input_layernorm.weight": np.ones(HIDDEN, np.float32),
    }
    write_ernie_pair("ernie45_moe_tiny", hf, {**MOE_CONFIG, "num_nextn_predict_layers": 1},
                     ("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeForCausalLM"), "ernie.layers.2.input_layernorm.weight",
                     hf_dtype=lambda n: "F32" if ".mlp.gate." in n or "moe_statics" in n else "BF16",
                     paddle_extra=mtp)


def write_qwen(name: str, config: dict[str, object], weights: dict[str, np.ndarray]) -> None:
    write_bpe_model(name, config, QWEN_GENERATION_CONFIG, weights)


def qwen2() -> None:
    w, s = Weights(np.random.default_rng(SEED + 3)), QWEN2
    w.decoder(s, lambda p, i: w.mlp(p, s.hidden, s.ffn), qkv_bias=True)
    w.normal("lm_head.weight", (s.vocab, s.hidden), EMBED_STD)
    write_qwen("qwen2_tiny", qwen_config("Qwen2ForCausalLM", "qwen2", s, tied=False), w.w)


def qwen3() -> None:
    w, s = Weights(np.random.default_rng(SEED + 4)), QWEN3
    w.decoder(s, lambda p, i: w.mlp(p, s.hidden, s.ffn), qk_norm=True)
    config = qwen_config("Qwen3ForCausalLM", "qwen3", s, tied=True, head_dim=s.head_dim, attention_bias=False)
    write_qwen("qwen3_tiny", config, w.w)


def qwen3_moe() -> None:
    w, s, moe = Weights(np.random.default_rng(SEED + 5)), QWEN3_MOE, QWEN3_MOE_EXPERTS

    def mlp(p: str, i: int) -> None:  # transformers' Qwen3MoeDecoderLayer rule
        if i in moe["mlp_only_layers"] or (i + 1) % moe["decoder_sparse_step"]:
            w.mlp(p, s.hidden, s.ffn)
            return
        w.normal(p + "gate.weight", (moe["num_experts"], s.hidden), ROUTER_STD)
        for e in range(moe["num_experts"]):
            w.mlp(p + f"experts.{e}.", s.hidden, moe["moe_intermediate_size"])
    w.decoder(s, mlp, qk_norm=True)
    w.normal("lm_head.weight", (s.vocab, s.hidden), EMBED_STD)
    config = qwen_config("Qwen3MoeForCausalLM", "qwen3_moe", s, tied=False, head_dim=s.head_dim,
                         attention_bias=False, output_router_logits=False, router_aux_loss_coef=0.001, **moe)
    write_qwen("qwen3_moe_tiny", config, w.w)


def write_bpe_model(name: str, config: dict[str, object], generation: dict[str, object],
                    weights: dict[str, np.ndarray]) -> None:
    out = fresh_dir(OUT / name)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", generation)
    write_safetensors(out / "model.safetensors", weights, "BF16")
    copy_tokenizer(out, "bpe_json")
    print(f"wrote {out}")


def llama3() -> None:
    """Field names and non-size values of Llama-3.1-8B's config.json (rope_scaling as it writes it)."""
    w, s = Weights(np.random.default_rng(SEED + 6)), LLAMA3
    w.decoder(s, lambda p, i: w.mlp(p, s.hidden, s.ffn))
    w.normal("lm_head.weight", (s.vocab, s.hidden), EMBED_STD)
    config = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1019, "eos_token_id": 1021, "head_dim": s.head_dim, "hidden_act": "silu",
        "hidden_size": s.hidden, "initializer_range": 0.02, "intermediate_size": s.ffn,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": s.heads, "num_hidden_layers": s.layers, "num_key_value_heads": s.kv_heads,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": LLAMA3_ROPE_SCALING, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": s.vocab,
    }
    # As Llama-3.1-8B-Instruct's generation_config.json (its eos list: end of text, of turn, of message).
    generation = {"bos_token_id": 1019, "do_sample": True, "eos_token_id": [1021, 1019], "temperature": 0.6,
                  "top_p": 0.9}
    write_bpe_model("llama3_tiny", config, generation, w.w)


def mistral() -> None:
    """Field names and non-size values of Mistral-7B-v0.3's config.json (no sliding window)."""
    w, s = Weights(np.random.default_rng(SEED + 7)), MISTRAL
    w.decoder(s, lambda p, i: w.mlp(p, s.hidden, s.ffn))
    w.normal("lm_head.weight", (s.vocab, s.hidden), EMBED_STD)
    config = {
        "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1019,
        "eos_token_id": 1021, "hidden_act": "silu", "hidden_size": s.hidden, "initializer_range": 0.02,
        "intermediate_size": s.ffn, "max_position_embeddings": 32768, "model_type": "mistral",
        "num_attention_heads": s.heads, "num_hidden_layers": s.layers, "num_key_value_heads": s.kv_heads,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": s.vocab,
    }
    write_bpe_model("mistral_tiny", config, {"bos_token_id": 1019, "eos_token_id": 1021}, w.w)


FAMILIES = {"ernie45": ernie45, "ernie45_moe": ernie45_moe, "qwen2": qwen2, "qwen3": qwen3, "qwen3_moe": qwen3_moe,
            "llama3": llama3, "mistral": mistral}


def main(argv: list[str]) -> None:
    unknown = sorted(set(argv) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; choose from {sorted(FAMILIES)}")
    for name in argv or FAMILIES:
        FAMILIES[name]()


if __name__ == "__main__":
    main(sys.argv[1:])
