"""Random checkpoints of real model shapes, streamed to disk shard by shard (never held in memory).
Used by benchmarks/large_models.py, and by tests with small shapes.

Two shapes, HF (-PT) layout, bf16 (the MoE router and its correction bias in float32, as transformers
keeps them):
  ernie-4.5-21b-a3b  vocab 103424, hidden 2560, 28 layers (layer 0 dense FFN 12288, then MoE: 64
                     experts, top-6, expert FFN 1536, 2 shared experts), 20 q / 4 kv heads x 128,
                     tied embeddings; 21.8 B parameters
  qwen2-7b           vocab 152064, hidden 3584, 28 layers, 28 q / 4 kv heads x 128, FFN 18944, q/k/v
                     biases, untied LM head; 7.6 B parameters
`layers` cuts the depth (the first layers, so a cut MoE model keeps its dense layer 0). Values come
from a pool of normal samples (std 0.02) read at rotating offsets: writing is bounded by the disk.
"""
from __future__ import annotations

import json
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_models import BASE_CONFIG, copy_tokenizer, to_bf16_bits  # noqa: E402

SHARD_BYTES = 4 << 30
STD = 0.02


@dataclass(frozen=True)
class ModelShape:
    family: str  # "ernie_moe" or "qwen2"
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0


SHAPES = {
    "ernie-4.5-21b-a3b": ModelShape("ernie_moe", vocab=103424, hidden=2560, layers=28, heads=20, kv_heads=4,
                                    head_dim=128, ffn=12288, experts=64, top_k=6, expert_ffn=1536, shared_experts=2),
    "qwen2-7b": ModelShape("qwen2", vocab=152064, hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128,
                           ffn=18944),
}

# (name, safetensors dtype, shape, fill) with fill "normal", "ones" or "small" (router bias)
Spec = tuple[str, str, tuple[int, ...], str]


def tensor_specs(s: ModelShape, layers: int) -> list[Spec]:
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    specs: list[Spec] = [("model.embed_tokens.weight", "BF16", (s.vocab, h), "normal")]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [(p + "input_layernorm.weight", "BF16", (h,), "ones"),
                  (p + "post_attention_layernorm.weight", "BF16", (h,), "ones"),
                  (p + "self_attn.q_proj.weight", "BF16", (q, h), "normal"),
                  (p + "self_attn.k_proj.weight", "BF16", (kv, h), "normal"),
                  (p + "self_attn.v_proj.weight", "BF16", (kv, h), "normal"),
                  (p + "self_attn.o_proj.weight", "BF16", (h, q), "normal")]
        if s.family == "qwen2":
            specs += [(p + f"self_attn.{n}_proj.bias", "BF16", (size,), "normal") for n, size in
                      (("q", q), ("k", kv), ("v", kv))]
        if s.family == "ernie_moe" and i > 0:
            specs += [(p + "mlp.gate.weight", "F32", (s.experts, h), "normal"),
                      (p + "mlp.moe_statics.e_score_correction_bias", "F32", (1, s.experts), "small")]
            for e in range(s.experts):
                specs += _mlp(f"{p}mlp.experts.{e}.", h, s.expert_ffn)
            specs += _mlp(p + "mlp.shared_experts.", h, s.expert_ffn * s.shared_experts)
        else:
            specs += _mlp(p + "mlp.", h, s.ffn)
    specs.append(("model.norm.weight", "BF16", (h,), "ones"))
    if s.family == "qwen2":
        specs.append(("lm_head.weight", "BF16", (s.vocab, h), "normal"))
    return specs


def _mlp(p: str, hidden: int, ffn: int) -> list[Spec]:
    return [(p + "gate_proj.weight", "BF16", (ffn, hidden), "normal"),
            (p + "up_proj.weight", "BF16", (ffn, hidden), "normal"),
            (p + "down_proj.weight", "BF16", (hidden, ffn), "normal")]


def config_for(s: ModelShape, layers: int) -> dict[str, object]:
    common = dict(hidden_size=s.hidden, num_hidden_layers=layers, num_attention_heads=s.heads,
                  num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=s.vocab, intermediate_size=s.ffn,
                  torch_dtype="bfloat16", max_position_embeddings=131072)
    if s.family == "qwen2":
        return dict(BASE_CONFIG, **common, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False)
    return dict(BASE_CONFIG, **common, architectures=["Ernie4_5_MoeForCausalLM"], model_type="ernie4_5_moe",
                rope_theta=500000.0, moe_num_experts=s.experts, moe_k=s.top_k,
                moe_intermediate_size=s.expert_ffn, moe_num_shared_experts=s.shared_experts,
                moe_layer_start_index=1, moe_layer_end_index=layers - 1, moe_layer_interval=1, moe_norm_min=1e-12,
                moe_gate_act="softmax", tie_word_embeddings=True)


_ITEM = {"BF16": 2, "F32": 4}


class _Pool:
    """Random bytes to write from: normal(0, STD) samples as bf16 and as float32."""

    def __init__(self, size: int = 1 << 25) -> None:
        normal = np.random.default_rng(0).standard_normal(size).astype(np.float32) * STD
        self.data = {"BF16": to_bf16_bits(normal).tobytes(), "F32": normal.tobytes()}
        self.offset = 0

    def write(self, f, dtype: str, count: int, fill: str) -> None:
        if fill == "ones":
            f.write((np.ones(count, np.float32) if dtype == "F32" else
                     to_bf16_bits(np.ones(count, np.float32))).tobytes())
            return
        if fill == "small":
            f.write((np.random.default_rng(count).standard_normal(count).astype(np.float32) * 1e-3).tobytes())
            return
        data, item = self.data[dtype], _ITEM[dtype]
        left = count * item
        while left:
            start = self.offset % len(data) // item * item
            n = min(left, len(data) - start)
            f.write(memoryview(data)[start:start + n])
            left -= n
            self.offset += n + 4099 * item  # a different phase next time


def write_checkpoint(out: Path, shape: ModelShape, layers: int, progress: bool = True) -> None:
    """Write config, tokenizer and sharded safetensors (+ index) into `out` unless already complete."""
    done = out / "model.safetensors.index.json"
    if done.exists():
        return
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    specs = tensor_specs(shape, layers)
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(np.prod(spec[2])) * _ITEM[spec[1]]
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    total = sum(int(np.prod(s[2])) * _ITEM[s[1]] for s in specs)
    pool = _Pool()
    weight_map = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}", disable=not progress) as bar:
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            header, offset = {}, 0
            for tname, dtype, tshape, _ in shard:
                nbytes = int(np.prod(tshape)) * _ITEM[dtype]
                header[tname] = {"dtype": dtype, "shape": list(tshape), "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
                weight_map[tname] = name
            raw = json.dumps(header).encode()
            raw += b" " * (-len(raw) % 8)
            with open(out / name, "wb") as f:
                f.write(struct.pack("<Q", len(raw)) + raw)
                for tname, dtype, tshape, fill in shard:
                    count = int(np.prod(tshape))
                    pool.write(f, dtype, count, fill)
                    bar.update(count * _ITEM[dtype])
    (out / "config.json").write_text(json.dumps(config_for(shape, layers), indent=2))
    copy_tokenizer(out)  # token ids beyond its vocabulary are never decoded: detokenize=False
    done.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
